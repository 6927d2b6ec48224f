"""moebench: look inside Mixture-of-Experts decoding on MLX.

    model, tokenizer = moebench.load()          # the shipped tiny Qwen2-MoE, or a folder
    with moebench.fused_moe(False): ...         # the fused decode-MoE kernel off for a block
"""

from .checkpoint.config import ModelArgs
from .checkpoint.loader import load
from .decode.loop import generate
from .decode.sampling import Sampling
from .errors import CheckpointError, ConfigError, MoebenchError, UnsupportedKernelConfig
from .execution.dispatch import available_backend, fused_moe, fused_moe_enabled, set_fused_moe
from .models.routing import Intervention

__all__ = [
    "CheckpointError", "ConfigError", "Intervention", "ModelArgs", "MoebenchError", "Sampling",
    "UnsupportedKernelConfig", "available_backend", "fused_moe", "fused_moe_enabled", "generate", "load",
    "set_fused_moe",
]
