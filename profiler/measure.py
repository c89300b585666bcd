"""Measure a model's per-layer costs on this machine's CPU or CUDA GPU.

For each kind of layer (embed, one block shared by all blocks, head), each TP degree and each
micro-batch size: forward and backward time of TP rank 0's shard (`profiler.layers`), the median of
`repeats` runs after `warmup` runs, with the interquartile range as the spread; and the activation
bytes that shard keeps for backward (`profiler.memory`). Times come from `time.perf_counter` on CPU.
On a GPU each interval is the longer of two clocks: CUDA events, the kernels' time, and
`time.perf_counter` on the host, the time to launch them. A layer whose kernels are short (gpt-small
on an H200) is bound by its launches: the GPU waits for the host, and a step takes the host's time,
which the events alone miss wherever the queue was already full when the layer began (the blocks'
backward behind the head's long kernels). In the timed backward each parameter's gradient goes where the
runtime sends it (runtime/dist_optim.py): a post-accumulate-grad hook adds it into an fp32 main
gradient and releases it, a kernel per parameter and micro-batch (and, where launches bound the
step, the hook's host time). Once per shard, the optimizer's share of a step on its parameters:
what `runtime.trainer` does to a stage's gradients besides the sync (zero them, sum their squares for
the global norm, scale them by the clip coefficient, AdamW step on the fp32 masters, publish the
masters into the module's parameters in their dtype), timed the same way.

Layers are timed where training runs them: in a chain embed, CHAIN_BLOCKS blocks, head, forward
front to back, then one backward from the loss, with a timestamp between every two layers each
way; a block's figures are the middle block's, whose neighbours are blocks both ways. The chain runs
twice, the second time with its blocks under full recomputation (`torch.utils.checkpoint`, as
runtime/stage.py wraps them): a block's `full_fwd_s` and `full_bwd_s`.
A layer run again and again on its own finds its weights and activations still in the core's caches,
which in training the layers between two of its runs have evicted: on two CPU cores, gpt-tiny's
whole model ran 10-20% slower than the sum of its layers timed alone; what the chain changes for
whole plans is in benchmarks/costmodel_accuracy.py's results.
"""

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from costmodel import analytic
from costmodel.config import ModelConfig
from costmodel.errors import ElastorError
from costmodel.profile import LayerCost, LayerProfile, ModelProfile
from profiler import defaults
from profiler.layers import KINDS, build_shard, example_input
from profiler.memory import cuda_activation_bytes, saved_tensor_bytes
from runtime.dist_optim import square_sum
from runtime.memory import LiveBytes
from runtime.optim import OptimConfig, build_optimizer

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A CPU run whose thread got less than this fraction of its wall time as CPU time was preempted by
# another process; it is discarded and run again, at most MAX_RETRIES_PER_RUN times per kept run.
# Under a load of 5 on 2 cores, back-to-back medians of one layer differed by up to 2x without this.
UNDISTURBED_CPU_FRACTION = 0.9
MAX_RETRIES_PER_RUN = 4
# Blocks in the timing chain (the module docstring): the middle one has blocks on both sides.
CHAIN_BLOCKS = 3
HOST_TIMER = "time.perf_counter"
# CUDA device names and the device kinds of costmodel.hardware they are (memory tells A100s apart).
CUDA_KINDS = (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100", "A100-{}GB"))


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ElastorError(
            "--device cuda needs a CUDA GPU but torch sees none here; use --device cpu, or --analytic "
            "--device-kind KIND for hardware you do not have."
        )


def cuda_device_kind() -> str:
    """The device kind of GPU 0 (H100-80GB ...), or its name when the hardware table lacks it."""
    props = torch.cuda.get_device_properties(0)
    for marker, kind in CUDA_KINDS:
        if marker in props.name:
            return kind.format(80 if props.total_memory > 48 * 2**30 else 40)
    return props.name


def cpu_name() -> str:
    """The CPU's model name where the OS tells it (Linux), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _stats(samples: list[float]) -> tuple[float, float]:
    """Median and interquartile range."""
    q1, median, q3 = np.percentile(samples, [25, 50, 75])
    return float(median), float(q3 - q1)


class _Clock:
    """Timestamps of one training step: the wall clock, and on a GPU CUDA events beside it."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.marks: list[float] = []
        self.events: list = []
        self.cpu0 = time.thread_time()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks: on a GPU, the longer of the kernels' and the host's."""
        host = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
        if not self.cuda:
            return host
        self.events[-1].synchronize()
        kernels = [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:], strict=False)]
        return [max(k, h) for k, h in zip(kernels, host, strict=True)]

    def undisturbed(self) -> bool:
        """With one thread, torch computes on this thread: CPU time short of wall time means the OS
        gave the core to another process mid-step (thread_time's resolution is far below a step's)."""
        if self.cuda or torch.get_num_threads() > 1:
            return True
        wall = self.marks[-1] - self.marks[0]
        return time.thread_time() - self.cpu0 >= UNDISTURBED_CPU_FRACTION * wall


def _chain_step(chain: Sequence[torch.nn.Module], ids: torch.Tensor, device: str) -> tuple[list, list, bool]:
    """One forward and backward of the chain as a stage runs them: (forward seconds, backward
    seconds) per layer in chain order, and whether the run was undisturbed. The backward is one call
    from the loss; a hook on each layer's output marks when its gradient arrives, which is when the
    layer after it has finished its backward."""
    if device == "cuda":
        torch.cuda.synchronize()
    clock = _Clock(device)
    clock.mark()
    x = ids
    for layer in chain:
        x = layer(x)
        clock.mark()
        if layer is not chain[-1]:
            x.register_hook(lambda _grad: clock.mark())
    x.backward()
    clock.mark()
    times = clock.intervals()
    n = len(chain)
    return times[:n], times[n:][::-1], clock.undisturbed()


class _Checkpointed(torch.nn.Module):
    """A block whose forward runs under `torch.utils.checkpoint` (non-reentrant), as a fully
    recomputed block does in runtime/stage.py: its backward reruns the forward first."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _main_gradient_hooks(chain: Sequence[torch.nn.Module]) -> tuple[list, list[torch.Tensor]]:
    """The runtime's gradient path on every parameter of the chain (runtime/dist_optim.py's hook):
    add the gradient into an fp32 main gradient, then release it. Returns the hooks' handles and
    the main gradients, in parameter order."""
    handles, mains = [], []
    for layer in chain:
        for param in layer.parameters():
            main = torch.zeros(param.shape, dtype=torch.float32, device=param.device)

            @torch.no_grad()
            def accumulate(p: torch.Tensor, main: torch.Tensor = main) -> None:
                main.add_(p.grad)
                p.grad = None

            handles.append(param.register_post_accumulate_grad_hook(accumulate))
            mains.append(main)
    return handles, mains


def _timed_chain(
    chain: Sequence[torch.nn.Module], ids: torch.Tensor, device: str, warmup: int, repeats: int
) -> tuple[list[list[float]], list[list[float]], int]:
    """Per layer of the chain, forward and backward seconds of `repeats` steps after `warmup` steps,
    and how many disturbed CPU steps were discarded on the way."""
    handles, _ = _main_gradient_hooks(chain)
    try:
        return _timed_steps(chain, ids, device, warmup, repeats)
    finally:
        for handle in handles:
            handle.remove()


def _timed_steps(
    chain: Sequence[torch.nn.Module], ids: torch.Tensor, device: str, warmup: int, repeats: int
) -> tuple[list[list[float]], list[list[float]], int]:
    """`_timed_chain`'s steps, once the gradient hooks are on."""
    fwd: list[list[float]] = [[] for _ in chain]
    bwd: list[list[float]] = [[] for _ in chain]
    kept, discarded = 0, 0
    for attempt in range(warmup + repeats * (1 + MAX_RETRIES_PER_RUN)):
        fwd_s, bwd_s, undisturbed = _chain_step(chain, ids, device)
        if attempt < warmup:
            continue
        if not undisturbed and discarded < repeats * MAX_RETRIES_PER_RUN:
            discarded += 1
            continue
        for i in range(len(chain)):
            fwd[i].append(fwd_s[i])
            bwd[i].append(bwd_s[i])
        kept += 1
        if kept == repeats:
            break
    return fwd, bwd, discarded


def _optimizer_s(shard: torch.nn.Module, device: str, warmup: int, repeats: int) -> tuple[float, int]:
    """Median seconds of the per-step optimizer work on `shard`'s parameters (the module docstring),
    and how many disturbed CPU runs were discarded. It runs on fp32 copies, as the runtime keeps fp32
    master weights in every dtype; AdamW's cost does not depend on the values."""
    module = dict(shard.named_parameters())
    params = {n: torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for n, p in module.items()}
    for p in params.values():
        p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(params, OptimConfig())
    times, discarded = [], 0
    for attempt in range(warmup + repeats * (1 + MAX_RETRIES_PER_RUN)):
        if device == "cuda":
            torch.cuda.synchronize()
        cpu0, t0 = time.thread_time(), time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        square_sum([p.grad for p in params.values()], device).item()
        for p in params.values():
            p.grad.mul_(0.5)  # the clip, as when the norm exceeds the threshold
        optimizer.step()
        with torch.no_grad():
            for name, master in params.items():  # publish (runtime/dist_optim.py)
                module[name].copy_(master)
        if device == "cuda":
            torch.cuda.synchronize()
        t1, cpu1 = time.perf_counter(), time.thread_time()
        if attempt < warmup:
            continue
        # One thread: CPU time short of wall time means another process took the core (_cpu_step).
        preempted = (
            device != "cuda"
            and torch.get_num_threads() == 1
            and cpu1 - cpu0 < UNDISTURBED_CPU_FRACTION * (t1 - t0)
        )
        if preempted and discarded < repeats * MAX_RETRIES_PER_RUN:
            discarded += 1
            continue
        times.append(t1 - t0)
        if len(times) == repeats:
            break
    return float(np.median(times)), discarded


def _activation(shard: torch.nn.Module, x: torch.Tensor, device: str) -> tuple[int, int]:
    """(kept, transient) activation bytes of one step: on CPU the storages autograd saves, and the
    peak the step's live storages reach above them (runtime.memory.LiveBytes); on CUDA the allocator."""
    targets = getattr(shard, "targets", None)
    if device != "cuda":
        _, kept = saved_tensor_bytes(shard, lambda: shard(x))
        with LiveBytes() as live:
            if targets is not None:
                shard.targets = targets.clone()
            out = shard(x.clone())
            out.backward(torch.ones_like(out) if out.dim() else None)
        x.grad = None
        return kept, max(live.peak - kept, 0)

    def forward() -> torch.Tensor:
        # Fresh copies made inside the measurement: freed at once unless the layer keeps them.
        if targets is not None:
            shard.targets = targets.clone()
        return shard(x.clone())

    def backward(out: torch.Tensor) -> None:
        out.backward(torch.ones_like(out) if out.dim() else None)

    kept, transient = cuda_activation_bytes(forward, backward)
    x.grad = None
    return kept, transient


@dataclass
class _Session:
    """One profiling run's settings, and the count of disturbed CPU runs it discarded."""

    config: ModelConfig
    seq_len: int
    device: str
    dtype: str
    repeats: int
    warmup: int
    generator: torch.Generator
    attention: str = "fused"
    discarded: int = 0

    def layer_costs(
        self, tp_degree: int, micro_batch_sizes: Sequence[int], tick: Callable[[], object]
    ) -> dict[str, list[LayerCost]]:
        """Per layer kind, the costs of TP rank 0's shard at each micro-batch size, timed in the chain."""
        dtype = TORCH_DTYPES[self.dtype]
        shards = {
            kind: build_shard(self.config, kind, tp_degree, self.device, dtype, self.attention)
            for kind in KINDS
        }
        blocks = [shards["block"]] + [
            build_shard(self.config, "block", tp_degree, self.device, dtype, self.attention)
            for _ in range(CHAIN_BLOCKS - 1)
        ]
        chain = [shards["embed"], *blocks, shards["head"]]
        position = {"embed": 0, "block": 1 + CHAIN_BLOCKS // 2, "head": len(chain) - 1}
        optimizer_s = {}
        for kind, shard in shards.items():
            optimizer_s[kind], discarded = _optimizer_s(shard, self.device, self.warmup, self.repeats)
            self.discarded += discarded
        costs: dict[str, list[LayerCost]] = {kind: [] for kind in KINDS}
        for mbs in micro_batch_sizes:
            inputs = {
                kind: example_input(shard, self.config, mbs, self.seq_len, self.generator)
                for kind, shard in shards.items()
            }  # the head's sets its targets
            fwd, bwd, discarded = _timed_chain(chain, inputs["embed"], self.device, self.warmup, self.repeats)
            # the blocks again under full recomputation, as runtime/stage.py checkpoints them
            full = [chain[0], *(_Checkpointed(b) for b in blocks), chain[-1]]
            full_fwd, full_bwd, more = _timed_chain(
                full, inputs["embed"], self.device, self.warmup, self.repeats
            )
            self.discarded += discarded + more
            for kind, shard in shards.items():
                at = position[kind]
                (fwd_s, fwd_spread), (bwd_s, bwd_spread) = _stats(fwd[at]), _stats(bwd[at])
                kept, transient = _activation(shard, inputs[kind], self.device)
                measured_full = {}
                if kind == "block":  # never below the plain layer's: checkpointing only adds work
                    measured_full = {
                        "full_fwd_s": max(_stats(full_fwd[at])[0], fwd_s),
                        "full_bwd_s": max(_stats(full_bwd[at])[0], bwd_s),
                    }
                costs[kind].append(
                    LayerCost(
                        micro_batch_size=mbs,
                        tp_degree=tp_degree,
                        fwd_s=fwd_s,
                        bwd_s=bwd_s,
                        activation_bytes=kept,
                        fwd_spread_s=fwd_spread,
                        bwd_spread_s=bwd_spread,
                        fwd_flops=analytic.forward_flops(self.config, kind, mbs, self.seq_len, tp_degree),
                        transient_bytes=transient,
                        optimizer_s=optimizer_s[kind],
                        **measured_full,
                    )
                )
            tick()
        return costs


def measure_profile(
    config: ModelConfig,
    *,
    micro_batch_sizes: Sequence[int],
    tp_degrees: Sequence[int],
    seq_len: int,
    device: str = "cpu",
    dtype: str = "float32",
    device_kind: str | None = None,
    repeats: int = defaults.REPEATS,
    warmup: int = defaults.WARMUP,
    threads: int | None = defaults.CPU_THREADS,
    seed: int = 0,
    progress: bool = True,
    attention: str = "fused",
) -> ModelProfile:
    """A measured `ModelProfile`: one shard per layer kind and TP degree, shared by identical layers.

    `threads` sets torch's intra-op threads for the measurement (None keeps torch's default).
    """
    check_device(device)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    session = _Session(config, seq_len, device, dtype, repeats, warmup, generator, attention)
    started = time.perf_counter()
    previous_threads = torch.get_num_threads()
    bar = tqdm(
        total=len(tp_degrees) * len(micro_batch_sizes),
        desc=f"profiling {config.name} on {device}",
        unit="shape",
        disable=not progress,
    )
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        threads_used = torch.get_num_threads()
        with bar:
            per_tp = [session.layer_costs(t, micro_batch_sizes, bar.update) for t in tp_degrees]
            costs = {kind: [c for measured in per_tp for c in measured[kind]] for kind in KINDS}
    finally:
        torch.set_num_threads(previous_threads)
    layers = []
    for i, name in enumerate(config.layer_names()):
        kind = config.layer_kind(i)
        layers.append(
            LayerProfile(
                name=name,
                param_count=config.layer_param_count(i),
                output_bytes_per_sample=analytic.output_bytes_per_sample(config, kind, seq_len, dtype),
                costs=tuple(costs[kind]),
            )
        )
    if device == "cuda":
        kind, hardware = device_kind or cuda_device_kind(), torch.cuda.get_device_name(0)
    else:
        kind, hardware = device_kind or "cpu", cpu_name()
    return ModelProfile(
        model=config,
        device_kind=kind,
        seq_len=seq_len,
        dtype=dtype,
        source=device,
        attention=attention,
        layers=tuple(layers),
        method={
            "timer": f"longer of CUDA events and {HOST_TIMER}" if device == "cuda" else HOST_TIMER,
            "memory": (
                "torch.cuda.memory_allocated after forward minus before; transient from max_memory_allocated"
                if device == "cuda"
                else "storages saved by autograd (saved_tensors_hooks), parameters excluded"
            ),
            "repeats": repeats,
            "warmup": warmup,
            "discarded_disturbed_runs": session.discarded,
            "statistic": "median; spread = interquartile range",
            "optimizer": "zero grads, squared-norm sum, clip, AdamW on fp32 masters, publish into the module",
            "gradients": "a post-accumulate-grad hook adds each into an fp32 main gradient and releases it",
            "full_recompute": "the chain again with its blocks under torch.utils.checkpoint (non-reentrant)",
            "shared": "one block measured, shared by every block",
            "context": f"timed in a chain embed, {CHAIN_BLOCKS} blocks (the middle one counts), head",
            "hardware": hardware,
            "threads": threads_used,
            "torch": torch.__version__,
            "wall_s": round(time.perf_counter() - started, 3),
        },
    )
