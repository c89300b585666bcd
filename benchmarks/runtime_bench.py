"""Runtime benchmark: (1) a pure data-parallel plan against DistributedDataParallel, (2) the bytes of the
cross-pipeline gradient sync against the minimum the layouts require, with and without ZeRO-1, (3) how
much of the gradient reduction overlapping it with backward hides, (4) interleaved 1F1B against 1F1B.

(1) Both trainers live in the same torchrun processes and take the same samples each step: Elastor's
`Trainer` on a plan of one whole-model pipeline per process, and `DistributedDataParallel` around the
reference model with the same micro-batches (gradient accumulation under `no_sync`), the same AdamW,
clipping and schedule. Steps alternate between the two (which one goes first alternates too), after
a barrier, so machine noise hits both alike; the figure is the ratio of median step times over 40
steps each (target <= 1.05; on a shared 2-core machine one run varies by about +-5%). Their losses
must agree: the comparison is between two ways of computing the same thing.

(2) For heterogeneous plans, every rank runs two training steps with the reductions issued after
backward (so that they run alone) and measures, around them and the ZeRO-1 all-gather only, the bytes
its process wrote to its sockets (Linux `/proc/self/io` wchar: what gloo really sent, headers
included) and the bytes its collectives carry by count (ring volumes per rank: all-reduce 2(n-1)/n
* S, reduce-scatter and all-gather (n-1)/n * S; Patarasuk & Yuan 2009 show no all-reduce sends
less). The minimum is derived here, element by element and independently of the buckets and their
groups: an element needs a reduction when devices of two or more stages hold it, and then its n
holders must together send at least 2(n-1) fp32 copies of it (all-reduce), or (n-1) fp32 copies to
reduce-scatter and (n-1) copies in the plan's dtype to gather it back (ZeRO-1). Target: measured /
minimum <= 1.05.

(3) Overlap: the same processes train the same plan with the reductions issued from backward's hooks
and, on alternate steps, all after backward; per step, the seconds from the end of the last
micro-batch's backward to the optimizer step (waiting for the reductions) and the step time. The
fraction hidden is 1 - overlapped wait / plain wait (medians).

(4) Interleaving: one pipeline of 4 stages and 8 micro-batches of gpt-tiny's widths with 6 blocks
(gpt-tiny itself has 6 layers, too few for 4 stages of 2 chunks), trained in the same 4 processes by
three trainers, one under 1F1B (2 layers per stage), one under interleaved 1F1B (2 chunks of one
layer per stage) and one under interleaved 1F1B with split backward (ZB-H1), step for step in
alternation (which one goes first rotates too): the median
step times side by side, and the cost model's prediction for both plans from the gpt-tiny CPU
profile (profiles/gpt-tiny-cpu.json, its block row standing for all six blocks).

    .venv/bin/python benchmarks/runtime_bench.py [--out benchmarks/results/runtime_bench.json]
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from costmodel import PRESETS, ModelConfig, Plan
from costmodel.jsonio import write_json
from costmodel.layout import device_pieces
from costmodel.table import format_table
from runtime.elastic.launch import failure_excerpt, run_local_torchrun

REPO = Path(__file__).resolve().parent.parent

FP32_BYTES = 4
DP_TARGET, SYNC_TARGET = 1.05, 1.05
# A model with 8x gpt-tiny's parameters, so that the gradient all-reduce weighs more in a step.
GPT_MINI = ModelConfig(
    name="gpt-mini",
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=688,
    num_blocks=4,
    num_heads=8,
    num_kv_heads=8,
    max_seq_len=256,
)
# (model, micro_batch_size, micro-batches per process, seq_len) of the DDP comparison.
DP_CASES = {
    "gpt-tiny": (PRESETS["gpt-tiny"], 4, 2, 128),
    "gpt-mini": (GPT_MINI, 2, 2, 128),
}


def _stages(*stages):
    return [{"layers": list(layers), "devices": devices} for layers, devices in stages]


def sync_plans() -> dict[str, dict]:
    tiny = PRESETS["gpt-tiny"].to_json()
    tied = ModelConfig(
        name="tied-gqa-tiny",
        vocab_size=250,
        hidden_size=48,
        intermediate_size=100,
        num_blocks=3,
        num_heads=6,
        num_kv_heads=3,
        max_seq_len=64,
        tie_embeddings=True,
    ).to_json()

    def plan(model, pipelines):
        return {
            "schema_version": 1,
            "model": model,
            "global_batch_size": sum(m for m, _ in pipelines),
            "micro_batch_size": 1,
            "seq_len": 32,
            "pipelines": [{"num_microbatches": m, "stages": st} for m, st in pipelines],
        }

    example = json.loads((REPO / "examples" / "plan-hetero.json").read_text())
    return {
        "examples/plan-hetero.json": example,
        "tp2+1 | 1+tp2 (5/3 mb)": plan(
            tiny,
            [
                (5, _stages(((0, 3), ["n0:0", "n0:1"]), ((3, 6), ["n0:2"]))),
                (3, _stages(((0, 2), ["n1:0"]), ((2, 6), ["n1:1", "n1:2"]))),
            ],
        ),
        "tp3+tp2 | 1 (6/2 mb)": plan(
            tiny,
            [
                (6, _stages(((0, 2), ["n0:0", "n0:1", "n0:2"]), ((2, 6), ["n0:3", "n0:4"]))),
                (2, _stages(((0, 6), ["n1:0"]))),
            ],
        ),
        "tied 1+1+tp3 | 1": plan(
            tied,
            [
                (2, _stages(((0, 1), ["n0:0"]), ((1, 3), ["n0:1"]), ((3, 5), ["n0:2", "n0:3", "n0:4"]))),
                (3, _stages(((0, 5), ["n1:0"]))),
            ],
        ),
        "pure DP x3": plan(tiny, [(3, _stages(((0, 6), [f"n{i}:0"]))) for i in range(3)]),
    }


def minimum_sync_bytes(plan: Plan) -> float:
    """Bytes all devices together must send to sum every gradient element held in two or more stages
    (and under ZeRO-1 to gather it back in the plan's dtype)."""
    dtype_bytes = {"float32": 4, "bfloat16": 2}[plan.dtype]
    copies = (  # per element with n holders: fp32 copies and dtype copies, times (n - 1)
        (FP32_BYTES + dtype_bytes) if plan.optimizer.sharding == "zero1" else 2 * FP32_BYTES
    )
    holders: dict[str, list] = {}
    for device in plan.devices:
        for spec, box in device_pieces(plan, device):
            holders.setdefault(spec.name, []).append((plan.placement(device), spec, box))
    total = 0.0
    for entries in holders.values():
        spec = entries[0][1]
        dim = spec.shard_dim if spec.shard_dim is not None else 0
        length = spec.shape[dim]
        per_index = int(np.prod(spec.shape)) // length
        devices = np.zeros(length, dtype=np.int64)
        stage_masks: dict[tuple, np.ndarray] = {}
        for placement, _, box in entries:
            lo, hi = box.offsets[dim], box.offsets[dim] + box.sizes[dim]
            devices[lo:hi] += 1
            stage_masks.setdefault(placement, np.zeros(length, dtype=bool))[lo:hi] = True
        stages = np.sum(list(stage_masks.values()), axis=0)
        needs = stages >= 2
        total += float(np.sum(devices[needs] - 1)) * per_index * copies
    return total


# ---- launching ----------------------------------------------------------------------------------
def _torchrun(nproc: int, args: list[str], timeout: float) -> None:
    """Run this file as the worker on `nproc` local processes (loopback only)."""
    script = str(Path(__file__).resolve())
    code, out = run_local_torchrun(nproc, [script, *args], timeout_s=timeout, cwd=str(REPO))
    if code != 0:
        raise SystemExit(f"runtime_bench: a torchrun worker failed (exit {code}):\n{failure_excerpt(out)}")


# ---- workers (run under torchrun) ---------------------------------------------------------------
def _join(plan: Plan):
    import torch

    from runtime.distributed import init_distributed

    torch.set_num_threads(1)
    return init_distributed(plan, device="cpu")


def _dp_worker(case: str, steps: int, result: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from runtime.data import SyntheticTokens, fetch, pipeline_samples
    from runtime.model import build_model, cross_entropy_sum
    from runtime.optim import OptimConfig, build_optimizer, set_lr
    from runtime.trainer import Trainer

    config, mb, m, seq = DP_CASES[case]
    world = int(os.environ["WORLD_SIZE"])
    plan = Plan.from_json(
        {
            "schema_version": 1,
            "model": config.to_json(),
            "global_batch_size": world * m * mb,
            "micro_batch_size": mb,
            "seq_len": seq,
            "pipelines": [
                {
                    "num_microbatches": m,
                    "stages": [{"layers": [0, config.num_layers], "devices": [f"n{i}:0"]}],
                }
                for i in range(world)
            ],
        }
    ).validate()
    ctx = _join(plan)
    optim = OptimConfig(lr=3e-4, warmup_steps=2, decay_steps=steps)
    ours = Trainer(plan, ctx, optim=optim, seed=0)
    model = build_model(config, seed=0)
    ddp = DistributedDataParallel(model)
    ddp_opt = build_optimizer(dict(model.named_parameters()), optim)
    source = SyntheticTokens(config.vocab_size, seq, seed=0)
    offset, count = pipeline_samples(plan, ctx.rank)
    batches = [fetch(source, k * plan.global_batch_size + offset, count).split(mb) for k in range(steps)]
    tokens = plan.global_batch_size * seq

    def ddp_step(k: int) -> float:
        ddp_opt.zero_grad(set_to_none=False)
        loss_sum = 0.0
        for j, micro in enumerate(batches[k]):
            with ddp.no_sync() if j < m - 1 else nullcontext():
                # DDP averages gradients over ranks; times the world size, the sum is the full-batch gradient.
                loss = cross_entropy_sum(ddp(micro[:, :-1]), micro[:, 1:]) / tokens
                (loss * world).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        set_lr(ddp_opt, optim.lr_at(k))
        ddp_opt.step()
        return loss_sum

    times = {"elastor": [], "ddp": []}
    losses = {"elastor": [], "ddp": []}
    for k in range(steps):
        order = ("elastor", "ddp") if k % 2 == 0 else ("ddp", "elastor")
        for who in order:
            dist.barrier()
            start = time.perf_counter()
            loss = ours.train_step().loss if who == "elastor" else ddp_step(k)
            times[who].append(time.perf_counter() - start)
            losses[who].append(loss)
    ddp_losses = torch.tensor(losses["ddp"])
    dist.all_reduce(ddp_losses)
    ours.close()
    if ctx.rank == 0:
        result.write_text(
            json.dumps({"times": times, "losses": {"elastor": losses["elastor"], "ddp": ddp_losses.tolist()}})
        )


def _proc_wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _sync_worker(plan_path: Path, result: Path) -> None:
    import torch.distributed as dist

    from runtime.optim import OptimConfig
    from runtime.trainer import Trainer

    plan = Plan.from_json(json.loads(plan_path.read_text())).validate()
    ctx = _join(plan)
    trainer = Trainer(plan, ctx, optim=OptimConfig(), seed=0)
    trainer.main.overlap = False  # every reduction in finish_reduction, alone on the sockets
    measured = [0]

    def measured_around(inner):
        def run() -> None:
            dist.barrier()
            before = _proc_wchar()
            inner()
            measured[0] += _proc_wchar() - before

        return run

    trainer.main.finish_reduction = measured_around(trainer.main.finish_reduction)
    trainer.main.publish = measured_around(trainer.main.publish)
    steps = 2
    for _ in range(steps):
        trainer.train_step()
    trainer.close()
    stats = trainer.main.stats
    mine = {
        "device": ctx.device_name,
        "measured_bytes": measured[0] / steps,
        "counted_bytes": stats.bytes_sent / steps,
        "collectives": stats.collectives // steps,
    }
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.rank == 0:
        result.write_text(json.dumps(everyone))


def _overlap_worker(plan_path: Path, steps: int, result: Path) -> None:
    import torch.distributed as dist

    from runtime.optim import OptimConfig
    from runtime.trainer import Trainer

    plan = Plan.from_json(json.loads(plan_path.read_text())).validate()
    ctx = _join(plan)
    trainer = Trainer(plan, ctx, optim=OptimConfig(), seed=0)
    main, waits = trainer.main, {True: [], False: []}
    inner = main.finish_reduction

    def timed() -> None:
        start = time.perf_counter()
        inner()
        waits[main.overlap].append(time.perf_counter() - start)

    main.finish_reduction = timed
    times = {True: [], False: []}
    for k in range(steps):
        main.overlap = k % 2 == 0
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        times[main.overlap].append(time.perf_counter() - start)
    trainer.close()
    mine = {"waits": {str(k): v for k, v in waits.items()}, "times": {str(k): v for k, v in times.items()}}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    if ctx.rank == 0:
        result.write_text(json.dumps(everyone))


# A gpt-tiny with 6 blocks: 8 layers, enough for 4 stages of 2 chunks.
GPT_TINY_DEEP = dataclasses.replace(PRESETS["gpt-tiny"], name="gpt-tiny-6-blocks", num_blocks=6)


SCHEDULES = ("1", "2", "2-split")  # v = 1, v = 2, v = 2 with its backwards split (ZB-H1)


def interleave_plans() -> dict[str, dict]:
    """The 4-stage, 8-micro-batch pipeline under 1F1B ("1"), interleaved 1F1B ("2") and interleaved
    1F1B with split backward ("2-split")."""
    devices = [[f"n0:{s}"] for s in range(4)]
    one = [((2 * s, 2 * s + 2), d) for s, d in enumerate(devices)]
    two = [(((s, s + 1), (4 + s, 5 + s)), d) for s, d in enumerate(devices)]

    def plan(stages, split=False):
        return {
            "schema_version": 1,
            "model": GPT_TINY_DEEP.to_json(),
            "global_batch_size": 16,
            "micro_batch_size": 2,
            "seq_len": 128,
            "pipelines": [
                {
                    "num_microbatches": 8,
                    "split_backward": split,
                    "stages": [
                        {"layers": [list(c) for c in r] if isinstance(r[0], tuple) else list(r), "devices": d}
                        for r, d in stages
                    ],
                }
            ],
        }

    return {"1": plan(one), "2": plan(two), "2-split": plan(two, split=True)}


def _interleave_worker(steps: int, result: Path) -> None:
    import torch.distributed as dist

    from runtime.optim import OptimConfig
    from runtime.trainer import Trainer

    plans = {v: Plan.from_json(p).validate() for v, p in interleave_plans().items()}
    ctx = _join(plans["1"])
    trainers = {v: Trainer(plan, ctx, optim=OptimConfig(), seed=0) for v, plan in plans.items()}
    times: dict[str, list[float]] = {v: [] for v in SCHEDULES}
    losses: dict[str, list[float]] = {v: [] for v in SCHEDULES}
    for k in range(steps):
        for v in SCHEDULES[k % 3 :] + SCHEDULES[: k % 3]:  # each goes first in turn
            dist.barrier()
            start = time.perf_counter()
            losses[v].append(trainers[v].train_step().loss)
            times[v].append(time.perf_counter() - start)
    for trainer in trainers.values():
        trainer.close()
    if ctx.rank == 0:
        result.write_text(json.dumps({"times": times, "losses": losses}))


def run_interleave(steps: int, tmp: Path) -> list[dict]:
    from costmodel.cluster import ClusterSpec
    from costmodel.estimate import CostModel
    from costmodel.profile import ModelProfile

    result = tmp / "interleave.json"
    _torchrun(4, ["--worker", "interleave", "--steps", str(steps), "--result", str(result)], 900)
    data = json.loads(result.read_text())
    warm = 2
    measured = {v: statistics.median(data["times"][v][warm:]) for v in SCHEDULES}
    tiny = json.loads((REPO / "profiles" / "gpt-tiny-cpu.json").read_text())
    block = tiny["layers"][1]
    blocks = [{**block, "name": f"blocks.{i}"} for i in range(GPT_TINY_DEEP.num_blocks)]
    profile = ModelProfile.from_json(
        {**tiny, "model": GPT_TINY_DEEP.to_json(), "layers": [tiny["layers"][0], *blocks, tiny["layers"][-1]]}
    )
    cm = CostModel(profile, ClusterSpec.parse("4", profile.device_kind))
    predicted = {v: cm.estimate(Plan.from_json(p)).pipeline_times_s[0] for v, p in interleave_plans().items()}
    gap = max(
        abs(a - b) / abs(b)
        for v in SCHEDULES[1:]
        for a, b in zip(data["losses"][v], data["losses"]["1"], strict=True)
    )
    return [
        {
            "plan": "gpt-tiny-6-blocks, 4 stages, 8 micro-batches of 2",
            "measured_s": measured,
            "measured_ratio_v2_over_v1": measured["2"] / measured["1"],
            "measured_ratio_split_over_v2": measured["2-split"] / measured["2"],
            "predicted_pipeline_s": predicted,
            "predicted_ratio_v2_over_v1": predicted["2"] / predicted["1"],
            "predicted_ratio_split_over_v2": predicted["2-split"] / predicted["2"],
            "max_loss_rel_diff": gap,
            "steps_timed": steps - warm,
        }
    ]


# ---- the driver ---------------------------------------------------------------------------------
def run_dp(procs: int, steps: int, tmp: Path) -> list[dict]:
    rows = []
    for case in DP_CASES:
        result = tmp / f"dp-{case}.json"
        _torchrun(
            procs, ["--worker", "dp", "--case", case, "--steps", str(steps), "--result", str(result)], 900
        )
        data = json.loads(result.read_text())
        warm = 2  # the first steps allocate buffers and warm caches on both sides
        ours, ddp = (statistics.median(data["times"][w][warm:]) for w in ("elastor", "ddp"))
        best_ours, best_ddp = (min(data["times"][w][warm:]) for w in ("elastor", "ddp"))
        loss_gap = max(abs(a - b) / abs(b) for a, b in zip(*data["losses"].values(), strict=True))
        rows.append(
            {
                "model": case,
                "processes": procs,
                "params": DP_CASES[case][0].param_count,
                "elastor_step_s": ours,
                "ddp_step_s": ddp,
                "ratio": ours / ddp,
                "best_step_ratio": best_ours / best_ddp,
                "max_loss_rel_diff": loss_gap,
                "steps_timed": steps - warm,
            }
        )
    return rows


def _variants(plan_json: dict) -> dict[str, dict]:
    """The plan unsharded, with ZeRO-1, and with ZeRO-1 in bf16."""
    return {
        "none": plan_json,
        "zero1": {**plan_json, "optimizer": {"sharding": "zero1"}},
        "zero1 bf16": {**plan_json, "optimizer": {"sharding": "zero1"}, "dtype": "bfloat16"},
    }


def run_sync(tmp: Path) -> list[dict]:
    rows = []
    for name, base in sync_plans().items():
        for variant, plan_json in _variants(base).items():
            plan = Plan.from_json(plan_json).validate()
            path, result = tmp / "plan.json", tmp / "sync.json"
            path.write_text(json.dumps(plan_json))
            _torchrun(
                plan.world_size, ["--worker", "sync", "--plan", str(path), "--result", str(result)], 600
            )
            ranks = json.loads(result.read_text())
            minimum = minimum_sync_bytes(plan)
            measured = sum(r["measured_bytes"] for r in ranks)
            counted = sum(r["counted_bytes"] for r in ranks)
            rows.append(
                {
                    "plan": name,
                    "optimizer": variant,
                    "devices": plan.world_size,
                    "collectives_per_rank_max": max(r["collectives"] for r in ranks),
                    "minimum_bytes": minimum,
                    "counted_bytes": counted,
                    "measured_bytes": measured,
                    "counted_over_minimum": counted / minimum if minimum else None,
                    "measured_over_minimum": measured / minimum if minimum else None,
                }
            )
    return rows


def overlap_plans() -> dict[str, dict]:
    """gpt-mini on 2 data-parallel replicas, and two pipelines of different cuts; 1 MiB buckets."""
    mini = GPT_MINI.to_json()

    def plan(pipelines, mbs):
        return {
            "schema_version": 1,
            "model": mini,
            "global_batch_size": sum(m for m, _ in pipelines) * mbs,
            "micro_batch_size": mbs,
            "seq_len": 128,
            "optimizer": {"sharding": "none", "bucket_bytes": 1 << 20},
            "pipelines": [{"num_microbatches": m, "stages": st} for m, st in pipelines],
        }

    return {
        "gpt-mini DP x2": plan([(2, _stages(((0, 6), [f"n{i}:0"]))) for i in range(2)], 2),
        "gpt-mini 2+2 | 3+1 stages": plan(
            [
                (4, _stages(((0, 3), ["n0:0"]), ((3, 6), ["n0:1"]))),
                (4, _stages(((0, 4), ["n1:0"]), ((4, 6), ["n1:1"]))),
            ],
            1,
        ),
    }


def run_overlap(steps: int, tmp: Path) -> list[dict]:
    rows = []
    for name, base in overlap_plans().items():
        for sharding in ("none", "zero1"):
            plan_json = {**base, "optimizer": {**base["optimizer"], "sharding": sharding}}
            plan = Plan.from_json(plan_json).validate()
            path, result = tmp / "plan.json", tmp / "overlap.json"
            path.write_text(json.dumps(plan_json))
            args = [
                "--worker",
                "overlap",
                "--plan",
                str(path),
                "--steps",
                str(steps),
                "--result",
                str(result),
            ]
            _torchrun(plan.world_size, args, 900)
            ranks = json.loads(result.read_text())
            warm = 2  # per mode: the first steps allocate and warm caches

            def median(kind: str, mode: str, ranks=ranks, warm=warm) -> float:
                """Median over timed steps of the slowest rank's seconds."""
                per_step = zip(*(r[kind][mode][warm:] for r in ranks), strict=True)
                return statistics.median(max(step) for step in per_step)

            hooked, plain = median("waits", "True"), median("waits", "False")
            rows.append(
                {
                    "plan": name,
                    "optimizer": sharding,
                    "devices": plan.world_size,
                    "wait_overlapped_s": hooked,
                    "wait_after_backward_s": plain,
                    "fraction_hidden": 1 - hooked / plain,
                    "step_overlapped_s": median("times", "True"),
                    "step_after_backward_s": median("times", "False"),
                }
            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "runtime_bench.json"))
    parser.add_argument("--procs", type=int, default=2, help="processes of the DDP comparison (default: 2)")
    parser.add_argument("--steps", type=int, default=42, help="steps per trainer in the DDP comparison")
    parser.add_argument(
        "--parts", default="dp,sync,overlap,interleave", help="which parts to run (default: %(default)s)"
    )
    parser.add_argument(
        "--overlap-steps", type=int, default=24, help="steps of the overlap part (both modes)"
    )
    parser.add_argument(
        "--interleave-steps", type=int, default=14, help="steps of the interleaving part (each schedule)"
    )
    parser.add_argument("--worker", choices=("dp", "sync", "overlap", "interleave"), help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from runtime.distributed import leave_job

        if args.worker == "dp":
            _dp_worker(args.case, args.steps, Path(args.result))
        elif args.worker == "sync":
            _sync_worker(Path(args.plan), Path(args.result))
        elif args.worker == "overlap":
            _overlap_worker(Path(args.plan), args.steps, Path(args.result))
        else:
            _interleave_worker(args.steps, Path(args.result))
        leave_job()  # the worker's trainers are gone: their groups are freed and joined here
        return 0

    parts = set(args.parts.split(","))
    if not parts or parts - {"dp", "sync", "overlap", "interleave"}:
        raise SystemExit(
            "runtime_bench: --parts takes a comma-separated subset of dp, sync, overlap, interleave."
        )
    with tempfile.TemporaryDirectory() as tmp:
        dp = run_dp(args.procs, args.steps, Path(tmp)) if "dp" in parts else []
        sync = run_sync(Path(tmp)) if "sync" in parts else []
        overlap = run_overlap(args.overlap_steps, Path(tmp)) if "overlap" in parts else []
        interleave = run_interleave(args.interleave_steps, Path(tmp)) if "interleave" in parts else []
    print(
        "(1) pure data parallelism: Elastor's runtime vs DistributedDataParallel, same processes and batches"
    )
    rows = [("model", "params", "procs", "elastor s/step", "DDP s/step", "ratio", "loss rel diff")]
    for r in dp:
        rows.append(
            (
                r["model"],
                f"{r['params']:,}",
                str(r["processes"]),
                f"{r['elastor_step_s']:.4f}",
                f"{r['ddp_step_s']:.4f}",
                f"{r['ratio']:.3f}",
                f"{r['max_loss_rel_diff']:.1e}",
            )
        )
    print(format_table(rows))
    print(f"target: ratio <= {DP_TARGET}\n")
    print("(2) cross-pipeline gradient sync: bytes sent per step by all ranks together")
    rows = [("plan", "optimizer", "devices", "minimum", "counted", "measured", "counted/min", "measured/min")]
    for r in sync:
        rows.append(
            (
                r["plan"],
                r["optimizer"],
                str(r["devices"]),
                f"{r['minimum_bytes']:,.0f}",
                f"{r['counted_bytes']:,.0f}",
                f"{r['measured_bytes']:,.0f}",
                f"{r['counted_over_minimum']:.4f}" if r["counted_over_minimum"] else "-",
                f"{r['measured_over_minimum']:.4f}" if r["measured_over_minimum"] else "-",
            )
        )
    print(format_table(rows))
    print(f"target: measured/min <= {SYNC_TARGET}\n")
    print("(3) overlap: wait for the reductions after backward, issued from hooks vs after backward")
    rows = [("plan", "optimizer", "wait hooked s", "wait after s", "hidden", "step hooked s", "step after s")]
    for r in overlap:
        rows.append(
            (
                r["plan"],
                r["optimizer"],
                f"{r['wait_overlapped_s']:.4f}",
                f"{r['wait_after_backward_s']:.4f}",
                f"{r['fraction_hidden']:.0%}",
                f"{r['step_overlapped_s']:.4f}",
                f"{r['step_after_backward_s']:.4f}",
            )
        )
    print(format_table(rows))
    print(
        "(4) interleaved 1F1B (and split backward) against 1F1B: same pipeline, same processes, "
        "alternating steps"
    )
    rows = [
        (
            "plan",
            "1F1B s/step",
            "interleaved s/step",
            "split s/step",
            "measured v2/v1",
            "predicted v2/v1",
            "measured split/v2",
            "predicted split/v2",
            "loss rel diff",
        )
    ]
    for r in interleave:
        rows.append(
            (
                r["plan"],
                f"{r['measured_s']['1']:.4f}",
                f"{r['measured_s']['2']:.4f}",
                f"{r['measured_s']['2-split']:.4f}",
                f"{r['measured_ratio_v2_over_v1']:.3f}",
                f"{r['predicted_ratio_v2_over_v1']:.3f}",
                f"{r['measured_ratio_split_over_v2']:.3f}",
                f"{r['predicted_ratio_split_over_v2']:.3f}",
                f"{r['max_loss_rel_diff']:.1e}",
            )
        )
    print(format_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the parts not run this time keep their previous figures
    report = json.loads(out.read_text()) if out.exists() else {}
    report.update({"schema_version": 1, "benchmark": "runtime", "dp_target_ratio": DP_TARGET})
    report["sync_target_ratio"] = SYNC_TARGET
    for part, key, rows in (
        ("dp", "dp_vs_ddp", dp),
        ("sync", "sync_bytes", sync),
        ("overlap", "overlap", overlap),
        ("interleave", "interleave", interleave),
    ):
        if part in parts:
            report[key] = rows
            report.setdefault("time_s_by_part", {})[part] = time.time()
    write_json(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
