"""ModelArgs: the Qwen2-MoE fields that change the computation, read from a checkpoint's config.json.

Unknown keys are ignored; a missing required key or an invalid value raises ConfigError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

QUANT_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# transformers' Qwen2MoeConfig default, used when config.json gives no rope_theta at all.
DEFAULT_ROPE_THETA = 10_000.0
# MLX's fixed (group size, bits) for the bias-free floating point modes.
FP_MODES = {"mxfp4": (32, 4), "mxfp8": (32, 8), "nvfp4": (16, 4)}


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

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen2-MoE's rule: MoE unless listed as MLP-only, and only every `decoder_sparse_step`-th layer."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        def integer(key: str, value: Any, minimum: int = 1) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"{source}: field {key!r} must be an integer >= {minimum}, got {value!r}")
            return value

        def number(key: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{source}: field {key!r} must be a positive number, got {value!r}")
            return float(value)

        def optional(key: str, default: Any) -> Any:
            """A field that may be absent or null (then `default`); any value given is validated."""
            value = cfg.get(key)
            return default if value is None else value

        def flag(key: str, value: Any) -> bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: field {key!r} must be true or false, got {value!r}")
            return value

        hidden = integer("hidden_size", need("hidden_size"))
        heads = integer("num_attention_heads", need("num_attention_heads"))
        kv_heads = integer("num_key_value_heads", optional("num_key_value_heads", heads))
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(f"{source}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads
        head_dim = integer("head_dim", head_dim)
        if head_dim % 2:
            raise ConfigError(f"{source}: field 'head_dim' must be even for rotary embeddings, got {head_dim}")

        rope_theta = cfg.get("rope_theta")
        for key in ("rope_parameters", "rope_scaling"):  # transformers 5 / 4 names of the RoPE settings
            rope = cfg.get(key)
            if not isinstance(rope, dict):
                continue
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type != "default":
                raise ConfigError(f"{source}: field {key!r}: rope_type {rope_type!r} is not supported (only 'default')")
            if rope_theta is None:
                rope_theta = rope.get("rope_theta")
        if optional("use_sliding_window", False) is not False:
            raise ConfigError(f"{source}: field 'use_sliding_window' is set; sliding-window attention is not supported")
        act = optional("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' is {act!r}; Qwen2-MoE experts use 'silu'")
        rope_theta = number("rope_theta", DEFAULT_ROPE_THETA if rope_theta is None else rope_theta)

        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
        experts_key = "num_experts" if "num_experts" in cfg or "num_local_experts" not in cfg else "num_local_experts"
        num_experts = integer(experts_key, need(experts_key), minimum=0)
        top_k = integer("num_experts_per_tok", need("num_experts_per_tok"))
        if num_experts and top_k > num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
        layers = integer("num_hidden_layers", need("num_hidden_layers"))
        mlp_only = optional("mlp_only_layers", [])
        if not isinstance(mlp_only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in mlp_only
        ):
            raise ConfigError(f"{source}: field 'mlp_only_layers' must list layer indices below {layers}")

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())

        return cls(
            model_type=str(cfg.get("model_type", "qwen2_moe")),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=integer("intermediate_size", need("intermediate_size")),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=integer("moe_intermediate_size", need("moe_intermediate_size")),
            shared_expert_intermediate_size=integer(
                "shared_expert_intermediate_size", optional("shared_expert_intermediate_size", 0), minimum=0
            ),
            norm_topk_prob=flag("norm_topk_prob", optional("norm_topk_prob", False)),
            decoder_sparse_step=integer("decoder_sparse_step", optional("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(mlp_only),
            rope_theta=rope_theta,
            rms_norm_eps=number("rms_norm_eps", need("rms_norm_eps")),
            tie_word_embeddings=flag("tie_word_embeddings", optional("tie_word_embeddings", False)),
            vocab_size=integer("vocab_size", need("vocab_size")),
            qkv_bias=flag("qkv_bias", optional("qkv_bias", optional("attention_bias", True))),
            quantization=_parse_quantization(cfg.get("quantization"), source),
            eos_token_id=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"{path}: no config.json here") from e
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: cannot read JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path}: top level must be a JSON object")
        return cls.from_dict(cfg, source=str(path))


def _parse_quantization(block: Any, source: str) -> Quantization | None:
    if block is None or block is False:
        return None
    if not isinstance(block, dict):
        raise ConfigError(f"{source}: field 'quantization' must be an object")

    def spec(obj: dict, where: str, base: QuantSpec | None) -> QuantSpec:
        gs = obj.get("group_size", base.group_size if base else 64)
        bits = obj.get("bits", base.bits if base else 4)
        mode = obj.get("mode", base.mode if base else "affine")
        for key, value in (("group_size", gs), ("bits", bits)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{source}: {where}.{key} must be an integer, got {value!r}")
        if not isinstance(mode, str):
            raise ConfigError(f"{source}: {where}.mode must be a string, got {mode!r}")
        result = QuantSpec(group_size=gs, bits=bits, mode=mode)
        result.validate(f"{source}: {where}")
        return result

    default = spec(block, "quantization", None)
    overrides: dict[str, QuantSpec | bool] = {}
    for key, value in block.items():
        if isinstance(value, dict):
            overrides[key] = spec(value, f"quantization[{key!r}]", default)
        elif value is False:
            overrides[key] = False
    return Quantization(default=default, overrides=overrides)
