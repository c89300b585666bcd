"""`elastor profile`: measure (or compute) a model's per-layer costs, and optionally the collectives.

The measured path needs torch and is imported only when it runs, so `--analytic` stays torch-free
and answers in well under a second.
"""

import argparse
import sys
import time

from costmodel.cluster import MAX_GPUS_PER_NODE
from costmodel.config import MAX_FIELD, ModelConfig, load_model_config
from costmodel.errors import ElastorError
from costmodel.hardware import DEVICE_KINDS
from costmodel.jsonio import output_path, shown, span, write_json
from costmodel.plan import DTYPES, MAX_GLOBAL_BATCH_SIZE
from costmodel.profile import ATTENTION_KERNELS, ModelProfile
from costmodel.table import format_table
from elastor.commands import subcommand
from elastor.commands.argtypes import integer
from profiler import defaults

MAX_DEFAULT_TP = 8  # default TP degrees: every degree up to one node of 8 GPUs that divides the heads
# Default tokens per sample: a CPU measures a short sequence (a model's layers in seconds, not hours);
# a GPU profile, measured or analytic, is for planning real training, so it takes the model's context
# length up to GPU_DEFAULT_SEQ_LEN (Llama 2's 4,096 and Llama 3's 8,192, the lengths they pretrained
# at; configs that extend the context to 128k train most steps far shorter).
CPU_DEFAULT_SEQ_LEN = 128
GPU_DEFAULT_SEQ_LEN = 8192
# Below about a megabyte, collectives on any link are latency-bound and a fit cannot see bandwidth.
MIN_COMM_MAX_BYTES = 1 << 20
# Repetitions of one measurement: the defaults take a handful; ten thousand is hours on a CPU.
MAX_REPEATS = 10_000
# Torch threads: past the cores of the largest hosts sold (2 x 192), more only contend.
MAX_THREADS = 1024
# The integer flags' ranges (checked with the others in check_flags; --help states each).
RANGES = {
    "repeats": (1, MAX_REPEATS),
    "warmup": (0, MAX_REPEATS),
    "threads": (1, MAX_THREADS),
    "comm_ranks": (1, MAX_GPUS_PER_NODE),  # local processes: one host
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subcommand(
        subparsers,
        "profile",
        "Measure a model's per-layer time and activation memory on this CPU or GPU, or compute them "
        "for a device kind you do not have (--analytic); --comm also measures the collectives.",
        "elastor profile --model gpt-tiny --device cpu --micro-batch-size 2 --seq-len 64 --out p.json\n"
        "  elastor profile --model llama2-70b --analytic --device-kind H100-80GB --out p70.json\n"
        "  elastor profile --model gpt-tiny --comm --cluster-out cluster.json --out p.json",
    )
    p.add_argument("--model", required=True, help="a preset (gpt-tiny, llama2-7b, ...) or a config.json path")
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to measure (default: cpu)")
    p.add_argument(
        "--analytic", action="store_true", help="compute from formulas for --device-kind instead of measuring"
    )
    p.add_argument(
        "--device-kind",
        help="hardware table entry (H100-80GB, A100-40GB, ...): required with --analytic; "
        "for a measurement it only labels the profile (default: cpu, or the GPU's kind)",
    )
    p.add_argument(
        "--micro-batch-size",
        default="1,2,4",
        help=f"micro-batch sizes, comma-separated, each in 1..{MAX_GLOBAL_BATCH_SIZE:,} "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--tp-degrees",
        help=f"tensor-parallel degrees, comma-separated (default: every degree up to {MAX_DEFAULT_TP} "
        "that divides the attention and key/value heads)",
    )
    p.add_argument(
        "--seq-len",
        type=integer(1, MAX_FIELD["max_seq_len"]),
        help="tokens per sample, at most the model's max_seq_len (default: with --analytic and on "
        f"CUDA the model's max_seq_len up to {GPU_DEFAULT_SEQ_LEN:,}; on a CPU {CPU_DEFAULT_SEQ_LEN}, "
        "or max_seq_len if shorter)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the dtype plans made from this profile train in (default: bfloat16 on CUDA and with "
        "--analytic, float32 on a CPU)",
    )
    p.add_argument(
        "--attention",
        choices=ATTENTION_KERNELS,
        default="fused",
        help="the attention kernel plans made from this profile run: fused (flash or memory-efficient, "
        "as scaled_dot_product_attention dispatches) or math (unfused, the s x s scores in memory, as "
        "Megatron-LM before FlashAttention) (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help=f"timed runs per shape when measuring, {span(*RANGES['repeats'])} (default: {defaults.REPEATS})",
    )
    p.add_argument(
        "--warmup",
        type=int,
        help=f"untimed runs before them, {span(*RANGES['warmup'])} (default: {defaults.WARMUP})",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=defaults.CPU_THREADS,
        help=f"torch threads when measuring, {span(*RANGES['threads'])} (default: %(default)s)",
    )
    p.add_argument(
        "--comm",
        action="store_true",
        help="also measure all-reduce, all-gather, reduce-scatter and send/recv between local processes",
    )
    p.add_argument("--cluster-out", help="with --comm: the cluster JSON to write the fitted links to")
    p.add_argument(
        "--comm-ranks",
        type=int,
        help=f"with --comm: largest group size, {span(*RANGES['comm_ranks'])} (default: every GPU up "
        "to 8; on CPU min(4, 2 x cores))",
    )
    p.add_argument(
        "--comm-max-bytes",
        type=int,
        default=64 << 20,
        help="with --comm: largest message, at least 1 MiB; sizes run from 4 bytes up by factors of 8 "
        "(default: 64 MiB)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


# ---- argument checks -----------------------------------------------------------------------------------
def parse_int_list(text: str, flag: str, high: int = MAX_GLOBAL_BATCH_SIZE) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and len(part) < 10 and 1 <= int(part) <= high for part in parts):
        raise ElastorError(
            f"{flag} takes positive integers up to {high:,} separated by commas, like 1,2,4, "
            f"not {shown(text)}."
        )
    return sorted({int(part) for part in parts})


def valid_tp_degrees(config: ModelConfig, limit: int = MAX_DEFAULT_TP) -> list[int]:
    return [t for t in range(1, limit + 1) if config.num_heads % t == 0 and config.num_kv_heads % t == 0]


def tp_degrees(config: ModelConfig, text: str | None) -> list[int]:
    if text is None:
        return valid_tp_degrees(config)
    degrees = parse_int_list(text, "--tp-degrees")
    bad = [t for t in degrees if config.num_heads % t or config.num_kv_heads % t]
    if bad:
        raise ElastorError(
            f"TP degree {bad[0]} does not divide {config.name}'s {config.num_heads} attention heads and "
            f"{config.num_kv_heads} key/value heads; use degrees among "
            f"{', '.join(map(str, valid_tp_degrees(config, config.num_heads)))}."
        )
    return degrees


def default_seq_len(args: argparse.Namespace, config: ModelConfig) -> int:
    """--seq-len's default (see the constants above)."""
    on_gpu = args.analytic or args.device == "cuda"
    return min(config.max_seq_len, GPU_DEFAULT_SEQ_LEN if on_gpu else CPU_DEFAULT_SEQ_LEN)


def check_flags(args: argparse.Namespace, config: ModelConfig) -> None:
    if not 1 <= args.seq_len <= config.max_seq_len:
        raise ElastorError(
            f"--seq-len {args.seq_len} is outside 1..{config.max_seq_len}, the range {config.name} supports."
        )
    if args.analytic:
        if args.device_kind is None:
            raise ElastorError("--analytic needs --device-kind, e.g. --device-kind H100-80GB.")
        if args.device == "cuda" or args.comm:
            raise ElastorError(
                "--analytic measures nothing; drop --device cuda and --comm, or drop --analytic."
            )
        if args.repeats is not None or args.warmup is not None:
            raise ElastorError("--repeats and --warmup apply to measurements; drop them with --analytic.")
    for flag, (low, high) in RANGES.items():
        value = getattr(args, flag)
        if value is not None and not low <= value <= high:
            bound = f"at least {low}" if value < low else f"at most {high:,}"
            raise ElastorError(f"--{flag.replace('_', '-')} must be {bound}, not {value}.")
    if args.comm and not args.cluster_out:
        raise ElastorError(
            "--comm writes its fits to a cluster file; name it with --cluster-out cluster.json."
        )
    if (args.cluster_out or args.comm_ranks) and not args.comm:
        raise ElastorError("--cluster-out and --comm-ranks apply to --comm; add --comm or drop them.")
    if args.comm_max_bytes < MIN_COMM_MAX_BYTES:
        raise ElastorError(
            f"--comm-max-bytes must be at least {MIN_COMM_MAX_BYTES} (1 MiB) for the fit to see a bandwidth, "
            f"not {args.comm_max_bytes}."
        )


# ---- output ----------------------------------------------------------------------------------------------
def profile_table(profile: ModelProfile) -> str:
    """One row per layer kind, TP degree and micro-batch size; identical blocks share one row. The
    last column: a block's forward and backward under full recomputation, where measured."""
    model = profile.model
    names = {"embed": "embed", "block": f"blocks.0..{model.num_blocks - 1}", "head": "head"}
    rows = [
        ("layer", "mbs", "tp", "fwd ms", "±", "bwd ms", "±", "activations", "GFLOP/s", "full recompute ms")
    ]
    for index in (0, 1, model.num_layers - 1):
        for c in sorted(profile.layers[index].costs, key=lambda c: (c.tp_degree, c.micro_batch_size)):
            total_s = c.fwd_s + c.bwd_s
            rate = 3 * c.fwd_flops / total_s / 1e9 if total_s > 0 and c.fwd_flops else 0.0
            rows.append(
                (
                    names[model.layer_kind(index)],
                    c.micro_batch_size,
                    c.tp_degree,
                    f"{c.fwd_s * 1e3:.3f}",
                    f"{c.fwd_spread_s * 1e3:.3f}",
                    f"{c.bwd_s * 1e3:.3f}",
                    f"{c.bwd_spread_s * 1e3:.3f}",
                    format_bytes(c.activation_bytes),
                    (f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}") if rate else "-",
                    "-" if c.full_fwd_s is None else f"{(c.full_fwd_s + c.full_bwd_s) * 1e3:.3f}",
                )
            )
    return format_table(rows)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.2f} GiB"


def comm_table(block: dict) -> str:
    rows = [("collective", "group", "latency us", "GB/s", "max rel err")]
    for name, fits in block.items():
        if name == "measurement":
            continue
        intra = fits["intra_node"]
        for group, fit in [("all", intra), *intra["by_group_size"].items()]:
            rows.append(
                (
                    name,
                    group,
                    f"{fit['latency_s'] * 1e6:.1f}",
                    f"{fit['bandwidth_gbps']:.3f}" + (" (table)" if "bandwidth_from" in fit else ""),
                    f"{fit['max_rel_error']:.2f}",
                )
            )
    return format_table(rows)


# ---- the command -------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    for out in (args.out, args.cluster_out):
        if out:
            output_path(out)  # a bad output fails now, not after the measurement
    config = load_model_config(args.model)
    micro_batch_sizes = parse_int_list(args.micro_batch_size, "--micro-batch-size")
    degrees = tp_degrees(config, args.tp_degrees)
    if args.seq_len is None:
        args.seq_len = default_seq_len(args, config)
    check_flags(args, config)
    if args.analytic:
        from profiler.analytic import analytic_profile

        profile = analytic_profile(
            config,
            device_kind=args.device_kind,
            micro_batch_sizes=micro_batch_sizes,
            tp_degrees=degrees,
            seq_len=args.seq_len,
            dtype=args.dtype or "bfloat16",
            attention=args.attention,
        )
    else:
        from profiler.measure import check_device, measure_profile

        check_device(args.device)
        profile = measure_profile(
            config,
            micro_batch_sizes=micro_batch_sizes,
            tp_degrees=degrees,
            seq_len=args.seq_len,
            device=args.device,
            dtype=args.dtype or ("bfloat16" if args.device == "cuda" else "float32"),
            device_kind=args.device_kind,
            repeats=defaults.REPEATS if args.repeats is None else args.repeats,
            warmup=defaults.WARMUP if args.warmup is None else args.warmup,
            threads=args.threads,
            progress=not args.quiet,
            attention=args.attention,
        )
    write_json(args.out, profile.to_json())
    print(profile_table(profile))
    how = "analytic" if args.analytic else "measured"
    print(
        f"wrote {args.out}: {config.name} on {profile.device_kind} ({how}, {profile.dtype}, "
        f"{profile.attention} attention, seq_len {profile.seq_len}) in {time.perf_counter() - started:.2f} s"
    )
    if args.comm:
        measure_comm(args, profile.device_kind)
    return 0


def measure_comm(args: argparse.Namespace, kind: str) -> None:
    from profiler.comm import (
        DEFAULT_SIZES,
        collectives_block,
        default_max_group_size,
        measure_collectives,
        measured_cluster,
    )

    started = time.perf_counter()
    ranks = args.comm_ranks or default_max_group_size(args.device)
    print(f"measuring collectives on 2..{ranks} local processes ...", file=sys.stderr, flush=True)
    sizes = [size for size in DEFAULT_SIZES if size <= args.comm_max_bytes]
    samples = measure_collectives(ranks, device=args.device, sizes=sizes)
    table = DEVICE_KINDS.get(kind, DEVICE_KINDS["cpu"])
    block = collectives_block(samples, "nccl" if args.device == "cuda" else "gloo", table.intra_node_gbps)
    cluster = measured_cluster(block, ranks, kind)
    write_json(args.cluster_out, cluster.to_json())
    print(comm_table(block))
    print(
        f"wrote {args.cluster_out}: one node n0 of {ranks} {kind} devices with the fitted links, in "
        f"{time.perf_counter() - started:.1f} s; one host measures intra-node only, inter-node is a copy"
    )
