"""moebench: look inside Mixture-of-Experts decoding on MLX.

    model, tokenizer = moebench.load()          # the shipped tiny Qwen2-MoE, or a folder
    with moebench.fused_moe(False): ...         # the fused decode-MoE kernel off for a block
"""

from .config import ModelArgs
from .decode import Sampling, generate
from .errors import CheckpointError, ConfigError, MoebenchError, UnsupportedKernelConfig
from .kernels import available_backend, fused_moe, fused_moe_enabled, set_fused_moe
from .loader import load
from .routing import Intervention

__all__ = [
    "CheckpointError", "ConfigError", "Intervention", "ModelArgs", "MoebenchError", "Sampling",
    "UnsupportedKernelConfig", "available_backend", "fused_moe", "fused_moe_enabled", "generate", "load",
    "set_fused_moe",
]
