"""moebench: look inside Mixture-of-Experts decoding on MLX.

    model, tokenizer = moebench.load()          # the shipped tiny Qwen2-MoE, or a folder
    with moebench.fused_moe(False): ...         # the fused decode kernels off for a block of code
    moebench.dispatch(model)                    # what ran, per layer: fused kernels or fallback, and why
"""

from .backend import require_mlx

require_mlx()  # before anything that imports MLX: without it, an error that names the extra to install

from .checkpoint.loader import default_model_path, load
from .decode.loop import generate
from .decode.sampling import Sampling
from .errors import (
    CheckpointError,
    ConfigError,
    DecodeError,
    DeviceMemoryError,
    MoebenchError,
    NonFiniteError,
    UnsupportedKernelConfig,
)
from .execution.executor import dispatch, fused_moe, fused_moe_enabled, set_fused_moe
from .execution.kernel import available_backend
from .models.args import ModelArgs
from .models.routing import Intervention

__all__ = [
    "CheckpointError", "ConfigError", "DecodeError", "DeviceMemoryError", "Intervention", "ModelArgs", "MoebenchError",
    "NonFiniteError", "Sampling", "UnsupportedKernelConfig", "available_backend", "default_model_path", "dispatch",
    "fused_moe", "fused_moe_enabled", "generate", "load", "set_fused_moe",
]
