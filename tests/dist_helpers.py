"""Shared helpers for the multi-process runtime tests: plans, torchrun launches, and the worker they run.

Every launch binds to 127.0.0.1 on a free port, runs in its own session, and is killed (its whole
process group, by id) if it outlives its timeout. Run as a script under torchrun, this file is the
worker: it trains a plan with the runtime's API, can fail on purpose, and saves what the tests check.
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.elastic.launch import NO_TORCHRUN_LOGS, free_port

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve()

# The parity runs' optimiser: warm-up then cosine inside 10 steps, clipping active in early steps.
# Adam divides each element's update by its own gradient scale, so float rounding in an element with
# a tiny gradient becomes lr x (its relative error): the tolerance of 1e-5 holds at this lr.
PARITY_OPTIM = {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 3, "decay_steps": 10, "grad_clip": 1.0}


@dataclass(frozen=True)
class Launch:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    ended_at: float  # wall clock (time.time()) when the command had exited
    stragglers: bool  # processes of its group outlived it and had to be killed


def torchrun(nproc: int, *args: str) -> list[str]:
    """The torchrun command line for `nproc` processes on this machine (args: script or -m module ...)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        f"--log-dir={NO_TORCHRUN_LOGS}",
        *args,
    ]


def elastor_run(
    tmp: Path,
    *flags: str,
    cluster: str = "1",
    steps: int = 2,
    profile: Path = REPO / "profiles" / "gpt-tiny-cpu.json",
    global_batch_size: int = 4,
) -> list[str]:
    """The `elastor run` command line of a small simulated job whose files are under `tmp`."""
    return [
        sys.executable,
        "-m",
        "elastor",
        "run",
        f"--cluster={cluster}",
        f"--profile={profile}",
        f"--global-batch-size={global_batch_size}",
        f"--steps={steps}",
        f"--ckpt-dir={tmp / 'ckpt'}",
        f"--metrics={tmp / 'metrics.jsonl'}",
        *flags,
    ]


def run_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's sockets on the loopback interface only
    return env


def launch(command: list[str], *, timeout: float, env: dict[str, str] | None = None) -> Launch:
    """Run `command` in its own session (with `env` over `run_env()`); kill its process group if it
    outlives `timeout`."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env={**run_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stragglers = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"timed out after {timeout} s"
    finally:
        ended_at = time.time()
        if proc.poll() is None or _group_alive(proc.pid):
            stragglers = True
            _kill_group(proc.pid)
            proc.communicate()
    return Launch(proc.returncode, out, err, time.monotonic() - start, ended_at, stragglers)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def plan_json(
    model: dict[str, Any],
    pipelines: list[tuple[int, list[tuple[tuple[int, int], list[str]]]]],
    *,
    micro_batch_size: int = 1,
    seq_len: int = 32,
) -> dict[str, Any]:
    """A plan from [(num_microbatches, [((start, end), [devices]), ...]), ...]; an interleaved stage
    gives its chunks, ((start, end), (start, end), ...), in place of (start, end)."""

    def layers(spec) -> list:
        return [list(c) for c in spec] if isinstance(spec[0], tuple | list) else list(spec)

    return {
        "schema_version": 1,
        "model": model,
        "global_batch_size": sum(m for m, _ in pipelines) * micro_batch_size,
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "pipelines": [
            {
                "num_microbatches": m,
                "stages": [{"layers": layers(spec), "devices": devices} for spec, devices in stages],
            }
            for m, stages in pipelines
        ],
    }


def run_worker(plan: dict[str, Any], out: Path, *, steps: int, timeout: float = 240, extra=()) -> Launch:
    """Train `plan` for `steps` steps under torchrun with this file as the worker."""
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan))
    nproc = sum(len(st["devices"]) for p in plan["pipelines"] for st in p["stages"])
    args = [str(WORKER), "train", "--plan", str(plan_path), "--steps", str(steps), "--out", str(out), *extra]
    return launch(torchrun(nproc, *args), timeout=timeout)


def assemble(out: Path) -> dict[str, Any]:
    """Full tensors (parameters, and AdamW moments when saved) from every rank's pieces in `out`;
    replicas must agree bit for bit and the pieces must cover every element."""
    import torch

    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("rank*.pt")):
        for name, shape, offsets, tensor in torch.load(path):
            if name not in full:
                full[name] = torch.zeros(shape)
                seen[name] = torch.zeros(shape, dtype=torch.bool)
            where = tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape, strict=True))
            overlap = seen[name][where]
            assert torch.equal(full[name][where][overlap], tensor[overlap]), f"replicas of {name} differ"
            full[name][where] = tensor
            seen[name][where] = True
    for name, mask in seen.items():
        assert mask.all(), f"{name} is not fully covered by the ranks' pieces"
    return full


# ---- the worker ---------------------------------------------------------------------------------
def _worker(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)
    from costmodel import Plan
    from runtime.distributed import init_distributed
    from runtime.loop import train
    from runtime.optim import OptimConfig
    from runtime.state import restore_training_state, state_pieces, training_state
    from runtime.trainer import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--fail", choices=("exception", "sigkill", "hang"))
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-step", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--save-at", type=int, default=-1, help="save the full state after this step")
    p.add_argument("--resume-from", help="a --save-at state directory, saved under any plan")
    p.add_argument("--measure-p2p", action="store_true", help="count the pipeline exchanges' socket bytes")
    p.add_argument(
        "--replan", help="after --replan-after steps, lose --lose and go on under this plan in-process"
    )
    p.add_argument("--replan-after", type=int, default=0)
    p.add_argument("--lose", help="the device whose process leaves at the re-plan")
    p.add_argument(
        "--lose-in",
        choices=("boundary", "forward", "reduction", "optimizer"),
        default="boundary",
        help="when --lose's process dies: after step --replan-after, or inside the next step (its "
        "pipeline schedule, its gradient reduction, or just before its optimizer step)",
    )
    args = p.parse_args(argv)

    marks = {"imported": time.time()}
    plan = Plan.from_json(json.loads(Path(args.plan).read_text())).validate()
    ctx = init_distributed(plan, timeout_s=args.timeout_s)
    marks["joined"] = time.time()
    trainer = Trainer(plan, ctx, optim=OptimConfig(**PARITY_OPTIM), seed=0, timeout_s=args.timeout_s)
    marks["built"] = time.time()
    out = Path(args.out)
    if args.measure_p2p:
        _count_exchange_bytes(trainer.schedule, out / f"p2p{ctx.rank}.json")

    if args.resume_from:
        resume = Path(args.resume_from)
        full = assemble(resume)
        local = {}
        for piece in state_pieces(trainer):
            where = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape, strict=True))
            local[piece.name, piece.offsets] = full[piece.name][where]
        restore_training_state(trainer, local, json.loads((resume / "meta.json").read_text()))

    def after_step(t, result) -> float:
        if args.fail and ctx.rank == args.fail_rank and result.step == args.fail_step:
            (out / "failed_at").write_text(str(time.time()))
            if args.fail == "exception":
                raise RuntimeError(f"injected failure on rank {ctx.rank}")
            if args.fail == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)
        if result.step == args.save_at:
            _save(t, out / "state", ctx.rank, with_optim=True)
        return 0.0

    from runtime.metrics import MetricsWriter

    if args.replan:
        if args.lose_in == "boundary":
            train(trainer, until_step=args.replan_after, after_step=after_step, progress=False)
        else:  # the lost process dies inside step replan_after + 1; the survivors notice
            if ctx.device_name == args.lose:
                _die_inside_step(trainer, args.replan_after + 1, args.lose_in)
            try:
                train(trainer, until_step=args.steps, after_step=after_step, progress=False)
                raise AssertionError("the survivors trained on without noticing the lost process")
            except RuntimeError:  # a collective or a transfer with the lost process failed
                (out / f"noticed{ctx.rank}").write_text(str(trainer.step))
        me = ctx.device_name
        state = training_state(trainer)
        trainer.close()
        trainer = None  # the last reference to the old process groups: leave_job frees them
        trainer, ctx, plan = _replan_in_process(state, me, plan, args, out)
        if trainer is None:
            return 0
    metrics = MetricsWriter(out / "metrics.jsonl") if ctx.rank == 0 else None
    results = train(trainer, until_step=args.steps, metrics=metrics, after_step=after_step, progress=False)
    if metrics:
        metrics.close()
    marks["trained"] = time.time()
    trainer.close()
    _save(trainer, out, ctx.rank, with_optim=False)
    if ctx.rank == 0:
        (out / "losses.json").write_text(json.dumps([r.loss for r in results]))
        (out / "timing.json").write_text(json.dumps(marks))
        (out / "module_dtype.txt").write_text(str(next(trainer.model.parameters()).dtype))
    from runtime.distributed import leave_job

    trainer = None  # the last reference to the process groups: leave_job frees them on this thread
    leave_job()
    (out / f"threads{ctx.rank}.json").write_text(json.dumps(native_threads()))
    return 0


def gloo_threads_left(out: Path) -> dict[str, list[str]]:
    """Per rank of a `run_worker` run, the gloo threads still alive after it left the job: none may
    be, or one finishing a collective during the interpreter's finalization aborts the process
    (`runtime.distributed.leave_job`)."""
    left = {}
    for path in sorted(out.glob("threads*.json")):
        names = json.loads(path.read_text())
        if names is None:
            import pytest

            pytest.skip("this OS does not list a process's threads in /proc")
        left[path.stem] = [n for n in names if "gloo" in n]
    assert left, f"no worker wrote its threads to {out}"
    return {rank: names for rank, names in left.items() if names}


def native_threads() -> list[str] | None:
    """The names of this process's threads as the OS knows them (gloo's are "gloo_tcp_loop" and
    "pt_gloo_runloop"); None where /proc does not list them."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    return sorted((task / "comm").read_text().strip() for task in tasks.iterdir())


def _die_inside_step(trainer, step: int, phase: str) -> None:
    """Make this process exit at once at `phase` of training step `step` (1-based)."""
    owner, name = {
        "forward": (trainer.schedule, "run"),
        "reduction": (trainer.main, "finish_reduction"),
        "optimizer": (trainer.optimizer, "step"),
    }[phase]
    original = getattr(owner, name)

    def dying(*a, **k):
        if trainer.step + 1 == step:
            os._exit(0)
        return original(*a, **k)

    setattr(owner, name, dying)


def _replan_in_process(state, me: str, plan, args, out: Path):
    """The survivors of losing device --lose go on under the --replan plan in the same processes: the
    old process group torn down, a new one over the survivors (a file store in `out`), the new
    plan's state fetched from the survivors' memory (runtime/elastic/peers.py), a trainer built for
    it and restored, no checkpoint file read. The lost device's process just leaves. `state` is the
    old trainer's `training_state`, the trainer itself closed and dropped (leave_job). Returns (None,
    None, None) there, else (trainer, its DistContext, the new plan); writes the phases' times."""
    import torch
    import torch.distributed as dist

    from costmodel import Plan
    from runtime.distributed import DistContext, leave_job
    from runtime.elastic.peers import agreed_step, fetch_state
    from runtime.optim import OptimConfig
    from runtime.state import restore_training_state
    from runtime.trainer import Trainer

    new = Plan.from_json(json.loads(Path(args.replan).read_text())).validate()
    survivors = list(new.devices)
    assert set(survivors) == set(plan.devices) - {args.lose}, "the new plan must use every survivor"
    marks = {"start": time.perf_counter()}
    pieces, meta = state
    leave_job()
    if me == args.lose:
        return None, None, None
    rank = survivors.index(me)
    store = dist.FileStore(str(out / "replan.store"), len(survivors))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=len(survivors))
    marks["joined"] = time.perf_counter()
    if agreed_step(meta["step"]) is None:
        raise AssertionError("the survivors stopped on different steps")
    tensors, transfers, received = fetch_state(
        pieces, plan, new, survivors, me, rank_of={d: i for i, d in enumerate(survivors)}
    )
    marks["fetched"] = time.perf_counter()
    ctx = DistContext(
        rank=rank, world_size=len(survivors), device_name=me, device=torch.device("cpu"), backend="gloo"
    )
    trainer = Trainer(new, ctx, optim=OptimConfig(**PARITY_OPTIM), seed=0)
    restore_training_state(trainer, tensors, meta)
    marks["restored"] = time.perf_counter()
    phases = {k: marks[k] - marks["start"] for k in ("joined", "fetched", "restored")}
    (out / f"replan{rank}.json").write_text(
        json.dumps({**phases, "received_bytes": received, "moves": len(transfers.moves)})
    )
    return trainer, ctx, new


def _proc_wchar() -> int:
    """Bytes this process has written (Linux; gloo's sockets included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _count_exchange_bytes(schedule, where: Path) -> None:
    """Wrap the schedule's exchanges: the bytes this process writes while each one runs (every send of
    an exchange is waited for inside it) and the payload it posts; saved after every exchange."""
    exchange = schedule._exchange
    counts = {"socket_bytes": 0, "exchanges": 0}

    def counted(*args):
        before = _proc_wchar()
        received = exchange(*args)
        counts["socket_bytes"] += _proc_wchar() - before
        counts["exchanges"] += 1
        counts["payload_bytes"], counts["messages"] = schedule.bytes_sent, schedule.messages_sent
        where.write_text(json.dumps(counts))
        return received

    schedule._exchange = counted


def _save(trainer, where: Path, rank: int, *, with_optim: bool) -> None:
    """This rank's pieces (and on rank 0 the JSON state) as the checkpoint contract gives them."""
    import torch

    from runtime.state import training_state

    pieces, meta = training_state(trainer)
    where.mkdir(parents=True, exist_ok=True)
    keep = [(p.name, p.global_shape, p.offsets, p.tensor.cpu().clone()) for p in pieces]
    if not with_optim:
        keep = [piece for piece in keep if not piece[0].startswith("optim.")]
    torch.save(keep, where / f"rank{rank}.pt")
    if rank == 0:
        (where / "meta.json").write_text(json.dumps(meta))


def _tp_layers(out: Path) -> int:
    """Each TP layer on this job's ranks against its plain single-device counterpart, forward and
    backward; writes the largest absolute difference per quantity to out/tp<rank>.json."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from costmodel import ModelConfig
    from costmodel.layout import layer_params, shard_box
    from runtime.model import Block, RMSNorm, rotary_tables
    from runtime.stage import box_slices
    from runtime.tensor_parallel import (
        VocabParallelEmbedding,
        VocabParallelHead,
        apply_tensor_parallel,
        vocab_parallel_cross_entropy_sum,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    config = ModelConfig(
        name="tp-check", vocab_size=250, hidden_size=48, intermediate_size=100, num_blocks=1,
        num_heads=6, num_kv_heads=3, max_seq_len=64,
    )  # fmt: skip
    specs = {s.name: s for i in range(config.num_layers) for s in layer_params(config, i)}

    def local(name: str, full: torch.Tensor) -> torch.Tensor:
        return full[box_slices(shard_box(specs[name], world, rank))]

    # Every rank draws the same full tensors (module constructors, whose shapes differ per rank,
    # do not touch this generator).
    gen = torch.Generator().manual_seed(0)
    diffs: dict[str, float] = {}

    def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        diffs[what] = (got.detach() - want.detach()).abs().max().item()

    # Vocabulary-parallel embedding.
    table = torch.randn(250, 48, requires_grad=True, generator=gen)
    tokens = torch.randint(0, 250, (2, 16), generator=gen)
    box = shard_box(specs["embed.weight"], world, rank)
    embed = VocabParallelEmbedding(box.sizes[0], 48, box.offsets[0], group)
    embed.weight.data.copy_(local("embed.weight", table.detach()))
    grad = torch.randn(2, 16, 48, generator=gen)
    mine, ref = embed(tokens), F.embedding(tokens, table)
    mine.backward(grad)
    ref.backward(grad)
    compare("embed.out", mine, ref)
    compare("embed.grad", embed.weight.grad, local("embed.weight", table.grad))

    # Head and vocabulary-parallel cross-entropy.
    x = torch.randn(2, 16, 48, generator=gen)
    norm_w, out_w = torch.rand(48, generator=gen) + 0.5, torch.randn(250, 48, generator=gen) * 0.2
    targets = torch.randint(0, 250, (2, 16), generator=gen)
    head = VocabParallelHead(config, box.sizes[0], group)
    head.norm.weight.data.copy_(norm_w)
    head.output.weight.data.copy_(local("head.output.weight", out_w))
    x_mine, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    norm = RMSNorm(48, config.norm_eps)
    norm.weight.data.copy_(norm_w)
    w_ref = out_w.clone().requires_grad_()
    loss_mine = vocab_parallel_cross_entropy_sum(head(x_mine, None), targets, box.offsets[0], group)
    loss_ref = F.cross_entropy(
        F.linear(norm(x_ref), w_ref).reshape(-1, 250), targets.reshape(-1), reduction="sum"
    )
    loss_mine.backward()
    loss_ref.backward()
    compare("ce.loss", loss_mine / loss_ref, torch.ones(()))
    compare("head.input_grad", x_mine.grad, x_ref.grad)
    compare("head.output_grad", head.output.weight.grad, local("head.output.weight", w_ref.grad))
    compare("head.norm_grad", head.norm.weight.grad, norm.weight.grad)

    # A block: column-parallel wq/wk/wv/gate/up, row-parallel wo/down, uneven MLP width.
    ref_block, tp_block = Block(config), apply_tensor_parallel(Block(config, world, rank), group)
    for name, p in ref_block.named_parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0))
        tp_p = dict(tp_block.named_parameters())[name]
        tp_p.data.copy_(local(f"blocks.0.{name}", p.data))
    cos, sin = rotary_tables(config, 16)
    x_mine, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(2, 16, 48, generator=gen)
    mine, ref = tp_block(x_mine, cos, sin), ref_block(x_ref, cos, sin)
    mine.backward(grad)
    ref.backward(grad)
    compare("block.out", mine, ref)
    compare("block.input_grad", x_mine.grad, x_ref.grad)
    for name, p in tp_block.named_parameters():
        compare(
            f"block.{name}.grad",
            p.grad,
            local(f"blocks.0.{name}", dict(ref_block.named_parameters())[name].grad),
        )

    (out / f"tp{rank}.json").write_text(json.dumps(diffs))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    sys.exit(_worker(rest) if mode == "train" else _tp_layers(Path(rest[0])))
