"""Reading a checkpoint's config.json (into moebench.models.args.ModelArgs) and generation_config.json.

Unknown keys are ignored; a missing required key or an invalid value raises ConfigError naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..models import family
from ..models.args import MODE_DEFAULTS, QUANT_MODES, ModelArgs, Quantization, QuantSpec, YarnScaling
from .files import checkpoint_file, parse_json

# transformers' Qwen2MoeConfig default, used when config.json gives no rope_theta at all.
DEFAULT_ROPE_THETA = 10_000.0
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
# Entry keys mlx-lm can write that change the arithmetic in ways moebench does not reproduce.
UNSUPPORTED_ENTRY_FLAGS = {
    "global_scale": "nvfp4 with a per-tensor global scale is not supported",
    "quantize_input": "quantized activations (QQLinear) are not supported",
}


def model_args(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """ModelArgs from a parsed config.json; a missing required key or an invalid value is a ConfigError naming it.
    The family (model_type) first fills the fields its config.json leaves out or names its own way. A multimodal
    folder's text model (`text_config`) is the model read."""
    cfg = text_model_config(cfg, source)
    model_type = cfg.get("model_type", "qwen2_moe")
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: field 'model_type' must be a string, got {model_type!r}")
    declared = family(model_type, source)
    cfg = {**cfg, **declared.config_fields(cfg)}

    def need(key: str) -> Any:
        if key not in cfg or cfg[key] is None:
            raise ConfigError(f"{source}: required field {key!r} is missing")
        return cfg[key]

    def integer(key: str, value: Any, minimum: int = 1) -> int:
        """An integer from `minimum` up to 2**31 - 1 (MLX's shapes are 32-bit: a larger size is no model)."""
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= INT32_MAX:
            raise ConfigError(f"{source}: field {key!r} must be an integer from {minimum} to {INT32_MAX}, got "
                              f"{value!r}")
        return value

    def number(key: str, value: Any) -> float:
        """A positive number that stays finite in float32 (JSON's Infinity and 1e39 would not)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= FLOAT32_MAX:
            raise ConfigError(f"{source}: field {key!r} must be a positive finite number, got {value!r}")
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

    rope_theta, rope_scaling = cfg.get("rope_theta"), None
    for key in ("rope_parameters", "rope_scaling"):  # transformers 5 / 4 names of the RoPE settings
        rope = cfg.get(key)
        if not isinstance(rope, dict):
            continue
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in declared.rope_types:
            raise ConfigError(f"{source}: field {key!r}: rope_type {rope_type!r} is not supported for {model_type} "
                              f"(supported: {list(declared.rope_types)})")
        if rope_type == "yarn" and rope_scaling is None:
            rope_scaling = _yarn(rope, f"{source}: field {key!r}")
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
    layer_types = optional("layer_types", [])
    kinds = declared.layer_types
    if not isinstance(layer_types, list) or (layer_types and len(layer_types) != layers) or \
            not all(t in kinds for t in layer_types):
        raise ConfigError(f"{source}: field 'layer_types' must list one of {list(kinds)} for each of the {layers} "
                          f"layers, got {layer_types!r}")
    window = None
    if "sliding_attention" in layer_types:
        window = integer("sliding_window", need("sliding_window"))
    limits = {key: None if cfg.get(key) is None else number(key, cfg[key]) for key in ("swiglu_limit", "swiglu_alpha")}
    family_fields = declared.own_fields(cfg, source)  # fields of ModelArgs only this family has, checked by it
    mlp_only = optional("mlp_only_layers", [])
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in mlp_only
    ):
        raise ConfigError(f"{source}: field 'mlp_only_layers' must list layer indices below {layers}")

    return ModelArgs(
        model_type=model_type,
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
        qkv_bias=flag("qkv_bias", need("qkv_bias")),
        quantization=_parse_quantization(cfg.get("quantization", _hub_quantization(cfg, source)), source),
        eos_token_id=token_ids(cfg.get("eos_token_id"), f"{source}: field 'eos_token_id'"),
        max_position_embeddings=None if cfg.get("max_position_embeddings") is None else integer(
            "max_position_embeddings", cfg["max_position_embeddings"]),
        clip_qkv=None if cfg.get("clip_qkv") is None else number("clip_qkv", cfg["clip_qkv"]),
        rope_scaling=rope_scaling,
        # every layer full: said as no types
        layer_types=tuple(layer_types) if set(layer_types) - {"full_attention"} else (),
        sliding_window=window,
        **limits,
        **family_fields,
    )


def text_model_config(cfg: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The config of the model moebench runs: a multimodal folder's `text_config` (Qwen3.5's, beside its
    vision_config), with the top level's fields where it has none (mlx-lm writes `quantization` there, transformers
    may put the eos ids and tie_word_embeddings there); any other config as it is."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' must be an object, got {text!r}")
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "model_type")}
    return {**top, **{k: v for k, v in text.items() if v is not None or k not in top}}


def _yarn(rope: dict[str, Any], where: str) -> YarnScaling:
    """A YaRN entry of `rope_parameters` / `rope_scaling`, with transformers' defaults (beta_fast 32, beta_slow 1,
    truncate true)."""

    def value(key: str, default: Any = None, kind: type = float) -> Any:
        v = rope.get(key)
        if v is None:
            if default is None and key in ("factor", "original_max_position_embeddings"):
                raise ConfigError(f"{where}: yarn needs {key!r}")
            return default
        if kind is bool:
            if not isinstance(v, bool):
                raise ConfigError(f"{where}: {key!r} must be true or false, got {v!r}")
            return v
        low = 0 if key.startswith("mscale") else math.ulp(0)  # an mscale of 0 means none (transformers)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= FLOAT32_MAX or \
                (kind is int and v != int(v)):
            raise ConfigError(f"{where}: {key!r} must be a positive {'integer' if kind is int else 'number'}, "
                              f"got {v!r}")
        return kind(v)

    return YarnScaling(factor=value("factor"),
                       original_max_position_embeddings=value("original_max_position_embeddings", kind=int),
                       beta_fast=value("beta_fast", 32.0), beta_slow=value("beta_slow", 1.0),
                       truncate=value("truncate", True, bool), attention_factor=value("attention_factor"),
                       mscale=value("mscale"), mscale_all_dim=value("mscale_all_dim"))

def read_model_args(path: str | Path) -> ModelArgs:
    """config.json, with the stop ids of generation_config.json beside it added (as mlx-lm stops on both)."""
    path = Path(path)
    try:
        cfg = read_json_object(path)
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no config.json here") from e
    args = model_args(cfg, source=str(path))
    generation = GenerationConfig.from_file(path.with_name(GENERATION_CONFIG))
    eos = tuple(dict.fromkeys(args.eos_token_id + generation.eos_token_id))
    return replace(args, eos_token_id=eos)


GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class GenerationConfig:
    """generation_config.json: the stop ids and sampling settings a checkpoint's authors publish.

    Values keep transformers' meaning: a setting left out is None (not applied), and without
    `do_sample: true` decoding is greedy (the repetition penalty still applies).
    """

    eos_token_id: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> GenerationConfig:
        """Read one; a folder without the file has no settings (every field at its default)."""
        path = Path(path)
        try:
            cfg = read_json_object(path)
        except FileNotFoundError:
            return cls()

        return cls(
            eos_token_id=token_ids(cfg.get("eos_token_id"), f"{path}: field 'eos_token_id'"),
            do_sample=bool(_setting(cfg, path, "do_sample")),
            temperature=_setting(cfg, path, "temperature"),
            top_p=_setting(cfg, path, "top_p"),
            top_k=_setting(cfg, path, "top_k"),
            repetition_penalty=_setting(cfg, path, "repetition_penalty"),
        )


# generation_config.json settings moebench applies: the JSON types accepted, the valid range, and its wording.
_SETTINGS = {
    "do_sample": ((bool,), lambda v: True, "true or false"),
    "temperature": ((int, float), lambda v: math.isfinite(v) and v >= 0, "a number >= 0"),
    "top_p": ((int, float), lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ((int,), lambda v: v >= 0, "an integer >= 0"),
    "repetition_penalty": ((int, float), lambda v: math.isfinite(v) and v > 0, "a positive number"),
}


def _setting(cfg: dict[str, Any], path: Path, key: str) -> Any:
    """One sampling setting, None when absent or null; a wrong type or range names the file and field."""
    value = cfg.get(key)
    if value is None:
        return None
    kinds, valid, wanted = _SETTINGS[key]
    if isinstance(value, bool) is not (bool in kinds) or not isinstance(value, kinds) or not valid(value):
        raise ConfigError(f"{path}: field {key!r} must be {wanted}, got {value!r}")
    return value


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file of a checkpoint folder (a regular file inside it: checkpoint_file) whose top level is an
    object; FileNotFoundError passes through for the caller to word (a link that dangles is a ConfigError)."""
    try:
        cfg = parse_json(checkpoint_file(path, path.parent, ConfigError).read_text(), path, ConfigError)
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    return cfg


def token_ids(value: Any, where: str) -> tuple[int, ...]:
    """An `eos_token_id` as config files write it: one id, a list of ids, or null."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{where} must be a token id or a list of them, got {value!r}")
    return tuple(values)


def _parse_quantization(block: Any, source: str) -> Quantization | None:
    """config.json's `quantization` block, read with mlx-lm's meaning (mlx_lm.utils.load_model).

    mlx-lm hands each per-module entry to MLX's `to_quantized` as written, so an entry never inherits
    from the block's top level: a missing `mode` is affine, and a missing or null `group_size` or `bits`
    is that mode's own default (affine 64 / 4, mxfp4 32 / 4, mxfp8 32 / 8, nvfp4 16 / 4). mlx-lm 0.31+
    writes its mixed recipes (`--quant-predicate mixed_3_6`) as per-module entries with `"group_size": null`.
    An entry `false` keeps the module float.
    """
    if block is None or block is False:
        return None
    if not isinstance(block, dict):
        raise ConfigError(f"{source}: field 'quantization' must be an object")
    default = _quant_spec(block, f"{source}: quantization")
    overrides: dict[str, QuantSpec | bool] = {}
    for key, value in block.items():
        if isinstance(value, dict):
            overrides[key] = _quant_spec(value, f"{source}: quantization[{key!r}]")
        elif value is False:
            overrides[key] = False
    return Quantization(default=default, overrides=overrides)


def _hub_quantization(cfg: dict[str, Any], source: str) -> dict | None:
    """The `quantization` block a config.json without one means by transformers' `quantization_config`: gpt-oss's
    published mxfp4 experts (quant_method 'mxfp4'; the tensors with scales are the quantized ones) as MLX's mxfp4
    reads them, as mlx-lm does. Any other method: None (a quantized tensor is then an error naming it)."""
    block = cfg.get("quantization_config")
    if isinstance(block, dict) and block.get("quant_method") == "mxfp4":
        return {"mode": "mxfp4"}
    return None


def _quant_spec(entry: dict, where: str) -> QuantSpec:
    """One entry (the top level or a module's) as MLX's `to_quantized` reads it; `where` names it in errors."""
    mode = entry.get("mode", "affine")
    if not isinstance(mode, str):
        raise ConfigError(f"{where}.mode must be a string, got {mode!r}")
    if mode not in MODE_DEFAULTS:
        raise ConfigError(f"{where}: quantization mode {mode!r} is not one of {QUANT_MODES}")
    for flag in UNSUPPORTED_ENTRY_FLAGS:
        if entry.get(flag):
            raise ConfigError(f"{where}.{flag} is set: {UNSUPPORTED_ENTRY_FLAGS[flag]}")
    values = {}
    for key, fallback in zip(("group_size", "bits"), MODE_DEFAULTS[mode], strict=True):
        value = entry.get(key)
        if value is None:
            value = fallback
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}.{key} must be an integer or null, got {value!r}")
        values[key] = value
    result = QuantSpec(group_size=values["group_size"], bits=values["bits"], mode=mode)
    result.validate(where)
    return result
