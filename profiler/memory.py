"""Activation memory of one forward pass: what stays allocated for backward.

CPU: count the tensors autograd actually saves (`torch.autograd.graph.saved_tensors_hooks`), each
distinct storage once (views of one buffer are one buffer), parameters excluded; this is exact and
independent of the allocator. CUDA: the caching allocator's counters, `memory_allocated` after the
forward minus before (the kept bytes) and `max_memory_allocated` over forward and backward (the
transient peak above them: workspaces, gradients in flight).
"""

from collections.abc import Callable

import torch
from torch import nn

from costmodel.config import ModelConfig
from profiler.layers import build_shard, example_input
from runtime.model import ModelSlice, cross_entropy_sum


def saved_tensor_bytes(module: nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run `forward` and return its output and the bytes of the distinct non-parameter storages saved."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    return out, sum(storages.values())


def cuda_activation_bytes(
    forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None]
) -> tuple[int, int]:
    """(kept, transient) bytes of one forward + backward on the current CUDA device.

    `forward` must make its input inside the call (a copy), so that an input the layer does not
    keep is freed again and one it keeps is counted, as on CPU. The output we hold is subtracted:
    no layer here keeps its own output, the next layer does.
    """
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    backward(out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return max(kept, 0), max(peak - kept, 0)


def measured_activation_bytes(
    config: ModelConfig,
    kind: str,
    micro_batch_size: int,
    seq_len: int,
    tp_degree: int,
    dtype: str,
    seed: int = 0,
    attention: str = "fused",
) -> int:
    """Saved-tensor bytes of TP rank 0's shard of a `kind` layer on CPU (the memory validation's truth)."""
    shard = build_shard(config, kind, tp_degree, "cpu", getattr(torch, dtype), attention)
    x = example_input(shard, config, micro_batch_size, seq_len, torch.Generator().manual_seed(seed))
    _, kept = saved_tensor_bytes(shard, lambda: shard(x))
    return kept


def measured_stage_activation_bytes(
    config: ModelConfig, start: int, end: int, micro_batch_size: int, seq_len: int, dtype: str, seed: int = 0
) -> int:
    """Saved-tensor bytes of the runtime's `ModelSlice` of layers [start, end) at TP degree 1, with the
    loss when it holds the head: checks that per-layer costs add up to a stage's."""
    torch_dtype = getattr(torch, dtype)
    stage = ModelSlice(config, start, end, seed=seed).to(torch_dtype)
    generator = torch.Generator().manual_seed(seed)
    shape = (micro_batch_size, seq_len)
    if start == 0:
        x = torch.randint(0, config.vocab_size, shape, generator=generator)
    else:
        x = torch.randn(*shape, config.hidden_size, generator=generator).to(torch_dtype).requires_grad_()
    targets = torch.randint(0, config.vocab_size, shape, generator=generator)

    def forward() -> torch.Tensor:
        out = stage(x)
        return cross_entropy_sum(out, targets) if end == config.num_layers else out

    _, kept = saved_tensor_bytes(stage, forward)
    return kept
