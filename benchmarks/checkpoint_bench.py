"""Elastor's checkpoint against torch.distributed.checkpoint (DCP): same state, processes and disk, one run.

    python benchmarks/checkpoint_bench.py                      # gpt-small, fp32 + AdamW: 1.49 GB, 4 processes
    python benchmarks/checkpoint_bench.py --model gpt-tiny     # seconds, for a smoke run

State: the model's parameters and AdamW moments (fp32) after a real training step, under plan A =
P/2 data-parallel replicas of one stage with TP=2 (so every tensor has two identical replicas to
deduplicate). Resharded loads go to plan B = one pipeline of P/2 stages with TP=2 each (different
holders, different stage boundaries). DCP holds the same tensors as DTensors (A: 2-D mesh,
Replicate x Shard; B: one mesh per stage), which is the only layout family DCP can save without
overlapping replicas.

Measured, each as the slowest rank after a barrier:
- step: one real forward + backward + AdamW step of this rank's share of the model (its TP shards);
- stall: how long save() blocks the training loop (Elastor: the host snapshot; DCP: the whole save;
  DCP async_save: its staging copy and planning), also as % of a step;
- save: from the save call until the checkpoint is durable and committed, the loop idle meanwhile;
  and the step time of a step that runs while an Elastor save is in flight;
- load: into plan A (same layout) and into plan B (resharded), with the page cache of every
  checkpoint file dropped first (posix_fadvise DONTNEED after fsync), so reads come from the disk;
- the disk itself: `dd` writes a file of the state's size through the page cache (conv=fsync) and
  with O_DIRECT (oflag=direct, as Elastor writes), and reads it back with the cache dropped; before
  and twice after the workers, the median reported (this shared disk drifts a lot).
Loaded tensors are checked: same-layout loads equal the live state, resharded loads of Elastor and
DCP equal each other, bit for bit.
"""

import argparse
import faulthandler
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from costmodel import PRESETS, Pipeline, Plan, Stage  # noqa: E402
from costmodel.jsonio import write_json  # noqa: E402
from costmodel.layout import device_pieces  # noqa: E402
from costmodel.table import format_table  # noqa: E402
from runtime.checkpoint import Checkpointer, load_checkpoint, wanted_for  # noqa: E402
from runtime.distributed import leave_job  # noqa: E402  (before any group: see its module)
from runtime.elastic.launch import free_port  # noqa: E402
from runtime.model import Block, RMSNorm, rotary_tables  # noqa: E402

KINDS = ("", "optim.exp_avg.", "optim.exp_avg_sq.")


# ---- plans and state ----------------------------------------------------------------------------
def plans(model: str, procs: int, seq_len: int) -> tuple[Plan, Plan]:
    config = PRESETS[model]
    L = config.num_layers
    a = tuple(
        Pipeline(
            num_microbatches=1, stages=(Stage(chunks=((0, L),), devices=(f"n0:{2 * i}", f"n0:{2 * i + 1}")),)
        )
        for i in range(procs // 2)
    )
    cuts = [round(i * L / (procs // 2)) for i in range(procs // 2 + 1)]
    b = (
        Pipeline(
            num_microbatches=procs // 2,
            stages=tuple(
                Stage(chunks=((cuts[i], cuts[i + 1]),), devices=(f"n0:{2 * i}", f"n0:{2 * i + 1}"))
                for i in range(procs // 2)
            ),
        ),
    )
    common = {"model": config, "micro_batch_size": 1, "seq_len": seq_len}
    return (
        Plan(global_batch_size=procs // 2, pipelines=a, **common).validate(),
        Plan(global_batch_size=procs // 2, pipelines=b, **common).validate(),
    )


def box_values(name: str, shape, offsets, sizes) -> torch.Tensor:
    """Deterministic values of a box from its global coordinates (cheap; identical on every replica)."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        axis = torch.arange(offsets[d], offsets[d] + sizes[d], dtype=torch.int64) * stride
        index = index + axis.view(*([1] * d), -1, *([1] * (len(shape) - d - 1)))
        stride *= shape[d]
    mixed = (index * 2654435761 + zlib.crc32(name.encode())) % 1000003
    return (mixed.float() / 1000003 - 0.5) * 0.04


class RankShare(nn.Module):
    """What one rank of plan A computes: every block's TP shard, the embedding's vocabulary shard, the
    final norm and the (tied) output over that shard. The TP collectives are left out: the point is a
    real step's compute time on this process, beside which the checkpoint's stall is measured."""

    def __init__(self, plan: Plan, rank: int):
        super().__init__()
        config, device = plan.model, plan.devices[rank]
        stage = plan.pipelines[plan.placement(device)[0]].stages[0]
        tp, tp_rank = stage.tp_degree, stage.devices.index(device)
        self.config = config
        self.embed = nn.Embedding(1, config.hidden_size)
        self.blocks = nn.ModuleDict({str(i): Block(config, tp, tp_rank) for i in range(config.num_blocks)})
        self.head = nn.Module()
        self.head.norm = RMSNorm(config.hidden_size, config.norm_eps)
        if not config.tie_embeddings:
            self.head.output = nn.Linear(config.hidden_size, 1, bias=False)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for spec, box in device_pieces(plan, device):
                params[spec.name].data = box_values(spec.name, spec.shape, box.offsets, box.sizes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        vocab = self.embed.weight.shape[0]
        x = F.embedding(tokens % vocab, self.embed.weight)
        cos, sin = rotary_tables(self.config, tokens.shape[1])
        for block in self.blocks.values():
            x = block(x, cos, sin)
        out = self.embed.weight if self.config.tie_embeddings else self.head.output.weight
        logits = F.linear(self.head.norm(x), out)
        return F.cross_entropy(logits.flatten(0, 1), (tokens.roll(-1, 1) % out.shape[0]).flatten())


def state_pieces(model: RankShare, optimizer, plan: Plan, rank: int) -> list[tuple]:
    params = dict(model.named_parameters())
    pieces = []
    for spec, box in device_pieces(plan, plan.devices[rank]):
        p = params[spec.name]
        tensors = (p.data, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
        pieces += [
            (kind + spec.name, spec.shape, box.offsets, t) for kind, t in zip(KINDS, tensors, strict=True)
        ]
    return pieces


def dcp_state(pieces, plan: Plan, rank: int, meshes) -> dict:
    """The same pieces as DTensors: sharded along the TP split, replicated across pipelines."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    device = plan.devices[rank]
    mesh, replicas = meshes[plan.placement(device)]
    specs = {spec.name: spec for spec, _ in device_pieces(plan, device)}
    state = {}
    for name, shape, _, tensor in pieces:
        spec = specs[name.removeprefix("optim.exp_avg.").removeprefix("optim.exp_avg_sq.")]
        split = [Replicate()] if spec.shard_dim is None else [Shard(spec.shard_dim)]
        placements = [Replicate()] * replicas + split
        stride = torch.empty(0).new_empty(shape, device="meta").stride()
        state[name] = DTensor.from_local(
            tensor, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
        )
    return state


def make_meshes(plan: Plan, procs: int):
    """(pipeline, stage) -> (device mesh, number of leading Replicate dims); every rank builds all."""
    from torch.distributed.device_mesh import DeviceMesh

    rank_of = {d: i for i, d in enumerate(plan.devices)}
    meshes = {}
    if all(len(p.stages) == 1 for p in plan.pipelines):  # plan A: one 2-D mesh (replica, TP)
        grid = torch.tensor([[rank_of[d] for d in p.stages[0].devices] for p in plan.pipelines])
        mesh = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp"))
        for pi in range(len(plan.pipelines)):
            meshes[(pi, 0)] = (mesh, 1)
    else:
        for pi, pipe in enumerate(plan.pipelines):
            for si, stage in enumerate(pipe.stages):
                meshes[(pi, si)] = (DeviceMesh("cpu", [rank_of[d] for d in stage.devices]), 0)
    return meshes


# ---- measurement helpers ------------------------------------------------------------------------
def drop_cache(root: Path) -> None:
    """Evict every file under `root` from the page cache (they are durable: sync first)."""
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def timed(fn) -> tuple[float, object]:
    """Run fn between barriers; the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    return slowest(time.perf_counter() - start), result


def disk_bandwidth(directory: Path, nbytes: int) -> dict:
    """dd writes (through the page cache with a final fsync, and with O_DIRECT), then reads the file
    back with it evicted from the page cache."""
    target = directory / "dd.bin"
    count = max(1, nbytes >> 20)
    result = {"bytes": count << 20}
    for key, flags in (("write_gbps", ["conv=fsync"]), ("write_direct_gbps", ["oflag=direct", "conv=fsync"])):
        start = time.perf_counter()
        command = ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", *flags]
        subprocess.run(command, check=True, capture_output=True)
        result[key] = (count << 20) / (time.perf_counter() - start) / 1e9
    drop_cache(directory)
    start = time.perf_counter()
    subprocess.run(["dd", f"if={target}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
    result["read_gbps"] = (count << 20) / (time.perf_counter() - start) / 1e9
    target.unlink()
    return result


class LoadChecks:
    """The four loads of the benchmark, and the checks of what they loaded."""

    def __init__(self, a, b, rank, pieces, state_a, meshes_a, meshes_b, ours_dir, dcp_dir):
        self.a, self.b, self.rank = a, b, rank
        self.state_a, self.meshes_a, self.meshes_b = state_a, meshes_a, meshes_b
        self.ours_dir, self.dcp_dir = ours_dir, dcp_dir
        self.live: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        for name, _, offsets, t in pieces:
            self.live.setdefault(name, []).append((tuple(offsets), t))
        self.wanted_a, self.wanted_b = wanted_for(a, rank), wanted_for(b, rank)
        self.result = None
        self.resharded_ours: dict[str, torch.Tensor] = {}

    def live_box(self, w) -> torch.Tensor:
        """The live state's values of a wanted box. A rank keeps, and loads, its rows of each
        parameter (`wanted_for`: `state_boxes`), which for a replicated parameter are a part of
        the whole tensor its module holds."""
        for offsets, t in self.live[w.name]:
            start = [o - p for o, p in zip(w.offsets, offsets, strict=True)]
            if all(a >= 0 and a + n <= m for a, n, m in zip(start, w.sizes, t.shape, strict=True)):
                return t[tuple(slice(a, a + n) for a, n in zip(start, w.sizes, strict=True))]
        raise KeyError(f"no live piece of {w.name} holds the box at {w.offsets}")

    def elastor_load_same(self) -> None:
        self.result = load_checkpoint(self.ours_dir, self.wanted_a, model=self.a.model)[0]

    def dcp_load_same(self) -> None:
        import torch.distributed.checkpoint as dcp

        targets = [(n, d.shape, None, torch.empty_like(d.to_local())) for n, d in self.state_a.items()]
        dcp.load(dcp_state(targets, self.a, self.rank, self.meshes_a), checkpoint_id=self.dcp_dir)
        self.result = targets

    def elastor_load_resharded(self) -> None:
        self.result = load_checkpoint(self.ours_dir, self.wanted_b, model=self.b.model)[0]

    def dcp_load_resharded(self) -> None:
        import torch.distributed.checkpoint as dcp

        targets = [(w.name, w.shape, w.offsets, torch.empty(w.sizes)) for w in self.wanted_b]
        dcp.load(dcp_state(targets, self.b, self.rank, self.meshes_b), checkpoint_id=self.dcp_dir)
        self.result = targets

    def check(self, name: str, first: bool) -> None:
        """Bit-identical: same-layout loads to the live state, resharded loads to each other."""
        result, self.result = self.result, None
        if not first:
            return
        if name == "elastor_load_same":
            for w, t in zip(self.wanted_a, result, strict=True):
                assert torch.equal(t, self.live_box(w)), f"{name}: {w.name} differs"
        elif name == "dcp_load_same":
            for n, _, _, t in result:
                assert torch.equal(t, self.state_a[n].to_local()), f"{name}: {n} differs"
        elif name == "elastor_load_resharded":
            self.resharded_ours = {w.name: t for w, t in zip(self.wanted_b, result, strict=True)}
        else:
            for n, _, _, t in result:
                assert torch.equal(t, self.resharded_ours[n]), f"Elastor and DCP resharded loads differ: {n}"
            self.resharded_ours = {}


# ---- the worker ---------------------------------------------------------------------------------
def worker(rank: int, args: argparse.Namespace, port: int, root: str, out: str) -> None:
    """One rank: the benchmark, then every process group freed and joined on this thread, before
    the interpreter's finalization (`runtime.distributed.leave_job`)."""
    if args.hang_report_s:
        faulthandler.dump_traceback_later(args.hang_report_s)
    _benchmark_rank(rank, args, port, root, out)
    leave_job()
    faulthandler.cancel_dump_traceback_later()


def _benchmark_rank(rank: int, args: argparse.Namespace, port: int, root: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.procs)
    root = Path(root)
    a, b = plans(args.model, args.procs, args.seq_len)
    results: dict = {"repeats": []}

    model = RankShare(a, rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)  # the same data on every replica keeps replicas equal
    tokens = torch.randint(0, a.model.vocab_size, (args.micro_batch_size, args.seq_len), generator=generator)

    # The TP pair's norm gradients are summed, as tensor parallelism's collectives make them equal:
    # replicas must stay identical for the deduplicated save (every rank builds every group, in order).
    tp_groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(args.procs // 2)]
    norms = [p for name, p in model.named_parameters() if name.endswith("norm.weight")]

    def step() -> None:
        for _ in range(args.microbatches):
            model(tokens).backward()
        for p in norms:
            dist.all_reduce(p.grad, group=tp_groups[rank // 2])
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()  # creates the AdamW state; warms up
    steps = [timed(step)[0] for _ in range(args.steps)]
    results["steps_s"] = steps
    pieces = state_pieces(model, optimizer, a, rank)
    results["state_bytes_per_rank"] = sum(t.numel() * t.element_size() for *_, t in pieces)
    meshes_a, meshes_b = make_meshes(a, args.procs), make_meshes(b, args.procs)
    state_a = dcp_state(pieces, a, rank, meshes_a)
    group = dist.new_group(backend="gloo")  # the session broadcast, off the default group
    checkpointer = Checkpointer(root / "elastor", a, rank, keep=1, group=group)

    for repeat in range(args.repeats):
        r: dict = {}
        # A training step while an Elastor save is in flight (it changes the state, so it comes first),
        # right after one without: the machine's load drifts.
        r["step_s"] = timed(step)[0]
        dist.barrier()
        checkpointer.save(repeat, pieces, {"step": repeat})
        r["step_during_elastor_save_s"] = timed(step)[0]
        checkpointer.wait()
        # Elastor: async save; the loop is blocked only until save() returns.
        dist.barrier()
        r["elastor_stall_s"] = slowest(checkpointer.save(repeat, pieces, {"step": repeat}))
        checkpointer.wait()
        r["elastor_save_s"] = slowest(checkpointer.last_save_s)
        # DCP, synchronous: the stall is the whole save.
        target = root / f"dcp-{repeat}"
        r["dcp_save_s"] = timed(lambda t=target: dcp.save(state_a, checkpoint_id=t))[0]
        r["dcp_stall_s"] = r["dcp_save_s"]
        # DCP async_save: staging and planning block; the write finishes in a thread.
        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save(state_a, checkpoint_id=root / f"dcp-async-{repeat}")
        r["dcp_async_stall_s"] = slowest(time.perf_counter() - start)
        future.result()
        r["dcp_async_save_s"] = slowest(time.perf_counter() - start)
        dist.barrier()
        if rank == 0:  # keep one DCP checkpoint (for the loads), as Elastor keeps one
            shutil.rmtree(root / f"dcp-async-{repeat}")
            if repeat:
                shutil.rmtree(root / f"dcp-{repeat - 1}")
        results["repeats"].append(r)
        pieces = state_pieces(model, optimizer, a, rank)  # the same tensors; a new list each time

    # Loads, each from a cold page cache, interleaved so that the disk's drift hits all alike.
    dcp_dir = root / f"dcp-{args.repeats - 1}"
    loads = LoadChecks(a, b, rank, pieces, state_a, meshes_a, meshes_b, root / "elastor", dcp_dir)
    results["loads"] = []
    for repeat in range(args.repeats):
        times = {}
        for name in ("elastor_load_same", "dcp_load_same", "elastor_load_resharded", "dcp_load_resharded"):
            if rank == 0:
                drop_cache(root)
            times[f"{name}_s"] = timed(getattr(loads, name))[0]
            loads.check(name, first=repeat == 0)
        results["loads"].append(times)

    if rank == 0:
        results["checkpoint_bytes"] = sum(f.stat().st_size for f in (root / "elastor").rglob("*.bin"))
        results["dcp_checkpoint_bytes"] = sum(f.stat().st_size for f in dcp_dir.rglob("*.distcp"))
        Path(out).write_text(json.dumps(results))
    dist.barrier()


# ---- main ---------------------------------------------------------------------------------------
def summarize(results: dict, disk: dict, args: argparse.Namespace) -> dict:
    def med(key):
        return statistics.median(r[key] for r in results["repeats"])

    state = results["checkpoint_bytes"]
    step = statistics.median(results["steps_s"] + [r["step_s"] for r in results["repeats"]])
    summary = {
        "step_s": step,
        "step_during_elastor_save_s": med("step_during_elastor_save_s"),
        "step_slowdown_during_elastor_save": statistics.median(
            r["step_during_elastor_save_s"] / r["step_s"] for r in results["repeats"]
        ),
        "state_bytes": state,
        "disk": disk,
    }
    for method in ("elastor", "dcp", "dcp_async"):
        summary[f"{method}_stall_s"] = med(f"{method}_stall_s")
        summary[f"{method}_save_s"] = med(f"{method}_save_s")
        summary[f"{method}_stall_pct_of_step"] = 100 * summary[f"{method}_stall_s"] / step
        summary[f"{method}_save_gbps"] = state / summary[f"{method}_save_s"] / 1e9
    for method in ("elastor", "dcp"):
        for kind in ("same", "resharded"):
            key = f"{method}_load_{kind}_s"
            summary[key] = statistics.median(r[key] for r in results["loads"])
    summary["ratios_elastor_over_dcp"] = {
        "stall": summary["elastor_stall_s"] / summary["dcp_stall_s"],
        "stall_vs_dcp_async": summary["elastor_stall_s"] / summary["dcp_async_stall_s"],
        "save": summary["elastor_save_s"] / summary["dcp_save_s"],
        "load_same": summary["elastor_load_same_s"] / summary["dcp_load_same_s"],
        "load_resharded": summary["elastor_load_resharded_s"] / summary["dcp_load_resharded_s"],
    }
    summary["targets"] = {
        "stall_le_5pct_of_step": summary["elastor_stall_pct_of_step"] <= 5,
        "save_ge_0.9_of_dd_write": summary["elastor_save_gbps"] >= 0.9 * disk["write_gbps"],
        "save_ge_0.9_of_dd_direct_write": summary["elastor_save_gbps"] >= 0.9 * disk["write_direct_gbps"],
        "resharded_load_le_1.2x_same": summary["elastor_load_resharded_s"]
        <= 1.2 * summary["elastor_load_same_s"],
        "all_dcp_ratios_lt_1": all(
            v < 1 for k, v in summary["ratios_elastor_over_dcp"].items() if k != "stall_vs_dcp_async"
        ),
    }
    return summary


def table(s: dict) -> str:
    gb = s["state_bytes"] / 1e9
    ratio = s["ratios_elastor_over_dcp"]
    methods = ("elastor", "dcp", "dcp_async")
    # (label, key pattern with {m} for the method, format, ratio key or None, methods that have it)
    lines = [
        ("stall per save (s)", "{m}_stall_s", ".3f", "stall", methods),
        ("stall, % of a step", "{m}_stall_pct_of_step", ".1f", None, methods),
        ("save until durable (s)", "{m}_save_s", ".2f", "save", methods),
        ("save throughput (GB/s)", "{m}_save_gbps", ".3f", None, methods),
        ("load, same layout (s)", "{m}_load_same_s", ".2f", "load_same", methods[:2]),
        ("load, resharded (s)", "{m}_load_resharded_s", ".2f", "load_resharded", methods[:2]),
    ]
    rows = [("measure", "Elastor", "DCP", "DCP async", "Elastor / DCP")]
    for label, key, fmt, ratio_key, have in lines:
        cells = [format(s[key.format(m=m)], fmt) if m in have else "" for m in methods]
        rows.append((label, *cells, format(ratio[ratio_key], ".3f") if ratio_key else ""))
    disk = s["disk"]
    return (
        f"state {gb:.2f} GB; training step {s['step_s']:.2f} s "
        f"(x{s['step_slowdown_during_elastor_save']:.2f} while an Elastor save is in flight); "
        f"dd: write {disk['write_gbps']:.3f} GB/s (conv=fsync), {disk['write_direct_gbps']:.3f} GB/s "
        f"(oflag=direct), read {disk['read_gbps']:.3f} GB/s (cold)\n"
        + format_table(rows)
        + "\ntargets: "
        + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in s["targets"].items())
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-small", choices=sorted(PRESETS), help="default: %(default)s")
    p.add_argument("--procs", type=int, default=4, help="processes, even, at least 4 (default: %(default)s)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per training step per rank")
    p.add_argument("--steps", type=int, default=3, help="training steps timed for the step time")
    p.add_argument("--repeats", type=int, default=2, help="saves per method (the median is reported)")
    p.add_argument("--dir", help="where to write (default: a temporary directory); the same disk for all")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "checkpoint_bench.json"))
    p.add_argument(
        "--hang-report-s",
        type=float,
        default=0,
        help="every process still running after this many seconds prints its threads' stacks to "
        "stderr (0: never; the test suite sets it below its own timeout)",
    )
    args = p.parse_args(argv)
    if args.hang_report_s:
        faulthandler.dump_traceback_later(args.hang_report_s)
    if args.procs < 4 or args.procs % 2:
        p.error("--procs must be even and at least 4 (plan A needs two TP=2 replicas)")

    root = Path(tempfile.mkdtemp(prefix="elastor-ckpt-bench-", dir=args.dir))
    load_before = os.getloadavg()  # this machine is shared: the run's context, kept with its results
    state_bytes = 12 * PRESETS[args.model].param_count  # fp32 parameters and two AdamW moments
    try:
        disks = [disk_bandwidth(root, state_bytes)]  # before and after the workers: the disk drifts
        raw = root / "results.json"
        port = free_port()
        mp.start_processes(
            worker, args=(args, port, str(root), str(raw)), nprocs=args.procs, start_method="spawn"
        )
        results = json.loads(raw.read_text())
        disks += [disk_bandwidth(root, state_bytes) for _ in range(2)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    disk = {
        "bytes": disks[0]["bytes"],
        "write_gbps": statistics.median(d["write_gbps"] for d in disks),
        "write_direct_gbps": statistics.median(d["write_direct_gbps"] for d in disks),
        "read_gbps": statistics.median(d["read_gbps"] for d in disks),
        "runs": disks,
    }
    summary = summarize(results, disk, args)
    summary["command"] = "python benchmarks/checkpoint_bench.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    summary["load_average_1min"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("out", "dir")}
    summary["raw"] = results
    print(table(summary))
    write_json(args.out, summary)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
