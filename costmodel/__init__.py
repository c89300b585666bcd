"""Cost model and the file contracts it reads: model config, cluster, profile, plan.

Pure Python, no torch: planning and what-if analysis run anywhere, fast. The types here are the
schema every other package speaks (the runtime reads `Plan`, the profiler writes `ModelProfile`).
"""

from costmodel.cluster import ClusterSpec, DeviceSpec, LinkSpec, NodeSpec
from costmodel.config import PRESETS, ModelConfig, load_model_config
from costmodel.errors import ElastorError
from costmodel.plan import Pipeline, Plan, PlanInvalid, Stage
from costmodel.profile import LayerCost, LayerProfile, ModelProfile

__all__ = [
    "PRESETS",
    "ClusterSpec",
    "DeviceSpec",
    "ElastorError",
    "LayerCost",
    "LayerProfile",
    "LinkSpec",
    "ModelConfig",
    "ModelProfile",
    "NodeSpec",
    "Pipeline",
    "Plan",
    "PlanInvalid",
    "Stage",
    "load_model_config",
]
