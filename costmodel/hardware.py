"""Device kinds Elastor can plan for without measuring them.

Bandwidths (`*_gbps`) are in gigabytes per second (1e9 bytes/s) per direction per GPU, the unit the
cluster file uses. Memory follows docs/DESIGN.md's convention of reading the nominal "80 GB" as GiB; the
cost model keeps a separate safety margin for what the driver and allocator take.

Sources:
- A100: NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s dense BF16, NVLink 600 GB/s
  bidirectional (300 GB/s per direction), HBM2e 1,555 / 2,039 GB/s.
- H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (2023): 989 TFLOP/s dense BF16, NVLink 900 GB/s
  bidirectional (450 per direction), HBM3 3.35 TB/s.
- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (2024): 989 TFLOP/s dense BF16, 141 GB HBM3e at
  4.8 TB/s, NVLink 900 GB/s bidirectional.
- Inter-node: one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100, H200) InfiniBand adapter per GPU, the
  DGX reference designs: 25 and 50 GB/s per direction.
- cpu: a placeholder for profiles measured on a CPU with gloo; `elastor profile --comm` replaces its
  links with measured values.
- NCCL channels (`nccl_channels`, for `costmodel.communicators`): NCCL opens 32 channels between two
  GPUs of an 8-GPU NVSwitch node of H100s (NVIDIA/nccl issue #1685: channels 00-31 per peer); the
  A100 and H200 NVSwitch nodes are taken alike. gloo on a CPU keeps no per-channel device buffers: 0.
"""

from dataclasses import asdict, dataclass

from costmodel.errors import ElastorError

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class DeviceKind:
    kind: str
    memory_bytes: int
    peak_flops: float  # dense 16-bit tensor-core FLOP/s (fp32 FLOP/s for cpu)
    memory_bandwidth_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    nccl_channels: int = 0  # NCCL channels of a communicator (and per point-to-point peer) in a node

    def to_json(self) -> dict:
        return asdict(self)


DEVICE_KINDS: dict[str, DeviceKind] = {
    d.kind: d
    for d in (
        DeviceKind(
            kind="A100-40GB",
            memory_bytes=40 * GIB,
            peak_flops=312e12,
            memory_bandwidth_gbps=1555,
            intra_node_gbps=300,
            inter_node_gbps=25,
            nccl_channels=32,
        ),
        DeviceKind(
            kind="A100-80GB",
            memory_bytes=80 * GIB,
            peak_flops=312e12,
            memory_bandwidth_gbps=2039,
            intra_node_gbps=300,
            inter_node_gbps=25,
            nccl_channels=32,
        ),
        DeviceKind(
            kind="H100-80GB",
            memory_bytes=80 * GIB,
            peak_flops=989e12,
            memory_bandwidth_gbps=3350,
            intra_node_gbps=450,
            inter_node_gbps=50,
            nccl_channels=32,
        ),
        DeviceKind(
            kind="H200-141GB",
            memory_bytes=141 * GIB,
            peak_flops=989e12,
            memory_bandwidth_gbps=4800,
            intra_node_gbps=450,
            inter_node_gbps=50,
            nccl_channels=32,
        ),
        DeviceKind(
            kind="cpu",
            memory_bytes=16 * GIB,
            peak_flops=100e9,
            memory_bandwidth_gbps=20,
            intra_node_gbps=2,
            inter_node_gbps=1,
        ),
    )
}


def device_kind(kind: str) -> DeviceKind:
    try:
        return DEVICE_KINDS[kind]
    except KeyError:
        raise ElastorError(
            f"Unknown device kind {kind!r}; known kinds are {', '.join(DEVICE_KINDS)}."
        ) from None
