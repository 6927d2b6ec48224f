"""Qwen3-Next and Qwen3.5-MoE checkpoints in the layouts they are published in, renamed into moebench's names.

moebench holds a hybrid as mlx-lm does: the text model under `model.` and `lm_head`, the decoder norms, the final
norm and the q/k norms as the factor itself (1 + w), the depthwise conv weight as MLX's [C, K, 1]. Checkpoints
store it in one of two layouts:

- transformers' (the hub's): Qwen3.5's folders are multimodal, the text model under `model.language_model.` and a
  vision tower under `model.visual.` (left out, and the load summary says so); those norms as offsets from 1
  (x_normed * (1 + w)); the conv weight [C, 1, K]; a multi-token-prediction head under `mtp.` (left out too);
  experts one by one or fused (`experts.gate_up_proj`, which moebench.checkpoint.weights.stack_experts reads for
  every family);
- mlx-lm's conversions: Qwen3.5's text model under `language_model.model.` and `language_model.lm_head`, the
  quantization entries under the same module paths; norms and conv already as moebench holds them.

Which one a folder is follows mlx-lm's rule: a conv weight whose last axis is not 1 is transformers'.
"""

from __future__ import annotations

import re
from dataclasses import replace

import mlx.core as mx

from ..errors import CheckpointError
from .args import ModelArgs
from .family import StoredTensors

# stored prefix -> moebench's (Qwen3.5's text model in transformers' and in mlx-lm's folders)
PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head", "lm_head"))
SKIPPED = {"model.visual.": "vision tower", "vision_tower.": "vision tower", "mtp.": "multi-token prediction head"}
OFFSET_NORMS = re.compile(r"^model\.(layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)\.|"
                          r"norm\.)weight$")
CONV = re.compile(r"^model\.layers\.\d+\.linear_attn\.conv1d\.weight$")


def to_moebench_names(store: StoredTensors, args: ModelArgs) -> ModelArgs:
    """Rename every tensor of `store` into moebench's names, leave out the vision tower and the MTP head (counted in
    store.skipped), and for transformers' layout turn the conv weights to [C, K, 1] and add 1 to the offset norms;
    a tensor of the wrong shape or type is a CheckpointError naming it. Returns `args` with the per-module
    quantization entries under moebench's names."""
    if args.quantization is not None:
        overrides = {_renamed(path): spec for path, spec in args.quantization.overrides.items()}
        args = replace(args, quantization=replace(args.quantization, overrides=overrides))
    for name in list(store.names()):
        prefix = next((p for p in SKIPPED if name.startswith(p)), None)
        if prefix is not None:
            store.skip(name, f"{SKIPPED[prefix]} ({prefix}*)")
        elif (new := _renamed(name)) != name:
            store.rename(name, new)
    convs = [name for name in store.names() if CONV.match(name)]
    if not any(store.peek(name).shape[-1] != 1 for name in convs):
        return args  # mlx-lm's layout: stored as moebench holds it
    for name in convs:
        _replace(store, name, 3, lambda w: w.moveaxis(2, 1))  # [C, 1, K] -> [C, K, 1]
    for name in [n for n in store.names() if OFFSET_NORMS.match(n)]:
        _replace(store, name, 1, lambda w: w + 1)
    return args


def _renamed(name: str) -> str:
    """A stored tensor's or module's name in moebench's names (the text model's prefix dropped)."""
    for stored, ours in PREFIXES:
        if name.startswith(stored):
            return ours + name.removeprefix(stored)
    return name


def _replace(store: StoredTensors, name: str, ndim: int, change) -> None:
    """`name` replaced by change(its value), once checked to be a float tensor of `ndim` axes."""
    where, value = store.where(name), store.take(name)
    if value.ndim != ndim or not mx.issubdtype(value.dtype, mx.floating):
        kind = str(value.dtype).removeprefix("mlx.core.")
        raise CheckpointError(f"{where}: {name} is {kind} {tuple(value.shape)}, expected a floating point tensor of "
                              f"{ndim} axes")
    store.put(name, change(value), where)
