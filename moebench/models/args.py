"""The values a model is built from, below the models and the checkpoint reader: ModelArgs (the fields of
config.json that change the computation), how modules are quantized (QuantSpec, Quantization), and the parts
of a quantized matrix (QuantizedParts). moebench.checkpoint fills them from files; the models and the
execution layer read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import ConfigError

QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# MLX's fixed (group size, bits) for the bias-free floating point modes.
FP_MODES = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}
# mlx.nn's (group size, bits) for a quantization entry that leaves them out or null, per mode.
MODE_DEFAULTS = {"affine": (64, 4), **FP_MODES}

@dataclass(frozen=True)
class QuantSpec:
    """How one module (or the default) is quantized."""

    group_size: int
    bits: int
    mode: str = "affine"

    def validate(self, where: str) -> None:
        """Check against MLX's rules so MLX never aborts on them."""
        if self.mode not in QUANT_MODES:
            raise ConfigError(f"{where}: quantization mode {self.mode!r} is not one of {QUANT_MODES}")
        if self.mode == "affine":
            if self.bits not in AFFINE_BITS:
                raise ConfigError(f"{where}: affine bits {self.bits} not in {AFFINE_BITS}")
            if self.group_size not in AFFINE_GROUP_SIZES:
                raise ConfigError(f"{where}: affine group_size {self.group_size} not in {AFFINE_GROUP_SIZES}")
        elif (self.group_size, self.bits) != FP_MODES[self.mode]:
            gs, bits = FP_MODES[self.mode]
            raise ConfigError(
                f"{where}: mode {self.mode} needs group_size {gs} and bits {bits}, "
                f"got {self.group_size} and {self.bits}"
            )


@dataclass(frozen=True)
class Quantization:
    """The config's `quantization` block: a default plus per-module overrides (or `False` to skip)."""

    default: QuantSpec
    overrides: dict[str, QuantSpec | bool] = field(default_factory=dict)

    def for_module(self, path: str) -> QuantSpec | None:
        """The spec for a module path, or None when the block says the module stays float."""
        override = self.overrides.get(path)
        if override is False:
            return None
        if isinstance(override, QuantSpec):
            return override
        return self.default


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling as config.json's `rope_parameters` / `rope_scaling` writes it (transformers' meaning):
    `truncate` rounds the correction range to whole dimensions; `attention_factor` None: derived from `factor`
    (and `mscale` / `mscale_all_dim` when both are given)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    vocab_size: int
    qkv_bias: bool = True
    quantization: Quantization | None = None
    eos_token_id: tuple[int, ...] = ()
    max_position_embeddings: int | None = None  # the longest sequence the model was made for (None: not given)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip_qkv, clip_qkv] (OLMoE's option; None: not)
    rope_scaling: YarnScaling | None = None  # None: plain RoPE at rope_theta
    # per layer 'full_attention', 'sliding_attention' or 'linear_attention' (empty: every layer full)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # positions a 'sliding_attention' layer sees, its own included
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU: the clamp and the sigmoid's gain
    swiglu_alpha: float | None = None
    # the hybrids' Gated DeltaNet layers (config.json's linear_* fields; 0: the model has none)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    partial_rotary_factor: float = 1.0  # the fraction of each attention head that is rotated
    family_args: object = None  # what only one family computes with, in its own declared type (its own_fields)

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen2-MoE's rule: MoE unless listed as MLP-only, and only every `decoder_sparse_step`-th layer."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class QuantizedParts:
    """What a quantized matrix (or stack of expert matrices) is made of; the fused kernel reads this."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    group_size: int
    bits: int
    mode: str

    @property
    def in_features(self) -> int:
        return self.weight.shape[-1] * 32 // self.bits

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]
