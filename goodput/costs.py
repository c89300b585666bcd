"""What a failure and a checkpoint cost in seconds: measured values from a JSON file, or defaults.

Recovery after a failure runs detect -> plan -> restart -> load, and training then redoes the steps
since the newest complete checkpoint. A checkpoint blocks training for `ckpt_stall_s` (the snapshot
of each GPU's shard to host memory) and becomes durable `ckpt_background_s` later (serialisation
and writes in the background); a failure before then loses it.

The defaults, each an order of magnitude to be replaced by measurements (`--costs costs.json` with
any of the fields of `RecoveryCosts`; the Checkpoint and Elastic benchmarks measure them, and
`elastor run` writes what it measured as `<metrics stem>-costs.json`, runtime.elastic.report):
- detection follows Elastor's own control plane (runtime/elastic) at `elastor run`'s default flags,
  as `benchmarks/recovery_bench.py` measures it (README, Elastic recovery: a killed worker noticed
  in 0.66 s; a lost host in the lease plus under a heartbeat; a frozen worker in the hang timeout
  plus under a progress period):
  - detect_s 20.5, a GPU or a job failure: the worker either ends (noticed in under a second) or
    hangs (noticed after `--hang-timeout-s` 20 s plus the 0.5 s progress period). The Llama 3
    report does not say which of its failures ended processes, so the default takes the slower
    case, an upper bound.
  - detect_node_s 11, a lost host: `--lease-s` 10 s plus the 1 s heartbeat period.
  A job that waits for a NCCL watchdog instead detects failures in minutes.
- plan_s 1: the solver's re-planning target (re-planning <= 1 s; README, Solver).
- restart_s 120: relaunching processes, rendezvous and building NCCL communicators on thousands of
  GPUs. An assumption; for scale, FlashRecovery (arXiv:2509.03047) reports restoring training on
  4,800 devices in 150 s and TrainMover reports about 20 s on 1,024 GPUs with standby machines.
- reform_s 30 and transfer_s, the in-process path (`elastor run --recovery in-process`): the survivors
  keep their processes, CUDA contexts and data; they leave the old process groups, join new ones and
  rebuild their stages (reform_s, an assumption: communicator creation for thousands of ranks
  without the process start and the checkpoint read of restart_s), then fetch the new plan's state
  from each other's memory (transfer_s: a GPU's share of the state over INTER_NODE_GBPS).
- checkpoint state: 12 bytes per parameter (fp32 parameters and AdamW's two moments, the tensors the
  checkpoint format stores, runtime/checkpoint/format.py); each pipeline holds a full copy, spread
  over its GPUs.
- stall: a GPU's share over DEVICE_TO_HOST_GBPS; background: the whole state over STORAGE_GBPS
  (each piece is written by exactly one rank); load: the state read once over STORAGE_GBPS then
  copied to the GPUs; a load into a different plan (reshard) takes RESHARD_FACTOR times that, an
  upper bound for resharded loads (README, Checkpoint).
"""

from dataclasses import asdict, dataclass, replace
from typing import Any

from costmodel import ElastorError, ModelConfig
from costmodel.jsonio import is_number

# elastor run's defaults (elastor/commands/run.py; a test holds them equal) and the periods of its
# heartbeats (runtime/elastic/rendezvous.py) and progress records (runtime/elastic/progress.py).
HANG_TIMEOUT_S, PROGRESS_PERIOD_S = 20.0, 0.5
LEASE_S, HEARTBEAT_S = 10.0, 1.0
DETECT_S = HANG_TIMEOUT_S + PROGRESS_PERIOD_S
DETECT_NODE_S = LEASE_S + HEARTBEAT_S
PLAN_S = 1.0
RESTART_S = 120.0
REFORM_S = 30.0
# A GPU's share of a 400 Gb/s network interface. Assumption (one NIC per GPU, as on DGX H100).
INTER_NODE_GBPS = 50.0
CHECKPOINT_BYTES_PER_PARAM = 12
# Pinned device-to-host copies reach roughly half of PCIe Gen5 x16's 64 GB/s per direction: assumption.
DEVICE_TO_HOST_GBPS = 25.0
# The file-system bandwidth one job gets. Assumption; the Llama 3 report's Tectonic file system
# sustains 2 TB/s for its whole 24K-GPU cluster.
STORAGE_GBPS = 200.0
RESHARD_FACTOR = 1.2


@dataclass(frozen=True, kw_only=True)
class RecoveryCosts:
    detect_s: float = DETECT_S  # a GPU or a job failure
    detect_node_s: float = DETECT_NODE_S  # a lost host
    plan_s: float = PLAN_S
    restart_s: float = RESTART_S
    load_s: float = 0.0  # the checkpoint into the same layout
    reshard_load_s: float = 0.0  # the checkpoint into a different plan
    reform_s: float = REFORM_S  # in-process: leave, re-form the groups, rebuild, first step
    transfer_s: float = 0.0  # in-process: the new plan's state from the survivors' memory
    ckpt_stall_s: float = 0.0
    ckpt_background_s: float = 0.0
    source: str = "defaults"

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "source" and not is_number(value, low=0):
                raise ElastorError(f"Recovery cost {name} must be a non-negative finite number of seconds.")

    @classmethod
    def defaults_for(cls, model: ModelConfig, num_gpus: int, num_pipelines: int) -> "RecoveryCosts":
        """The documented defaults for `model` trained on `num_gpus` GPUs in `num_pipelines` pipelines."""
        state_bytes = model.param_count * CHECKPOINT_BYTES_PER_PARAM
        shard_bytes = state_bytes * num_pipelines / num_gpus
        stall = shard_bytes / (DEVICE_TO_HOST_GBPS * 1e9)
        write = state_bytes / (STORAGE_GBPS * 1e9)
        load = write + stall
        return cls(
            load_s=load,
            reshard_load_s=load * RESHARD_FACTOR,
            transfer_s=shard_bytes / (INTER_NODE_GBPS * 1e9),
            ckpt_stall_s=stall,
            ckpt_background_s=write,
        )

    def updated(self, data: dict[str, Any], source: str) -> "RecoveryCosts":
        """These costs with the fields present in `data` (a measured-costs JSON object) replaced."""
        fields = set(self.__dataclass_fields__) - {"source"}
        unknown = sorted(set(data) - fields - {"schema_version"})
        if unknown:
            raise ElastorError(
                f"The costs file has unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(fields))}."
            )
        values = {k: v for k, v in data.items() if k in fields}  # checked by __post_init__
        if not is_number(values.get("load_s", 0.0), low=0):
            raise ElastorError("Recovery cost load_s must be a non-negative finite number of seconds.")
        if "load_s" in values and "reshard_load_s" not in values:
            values["reshard_load_s"] = values["load_s"] * RESHARD_FACTOR
        return replace(self, **values, source=source)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
