"""gpt-oss checkpoints in the layouts they are published in, renamed and reshaped into moebench's names.

moebench holds a gpt-oss MoE block as every family's: the router at `mlp.gate` (weight and bias) and the experts
stacked at `mlp.switch_mlp.{gate,up,down}_proj` ([E, out, in], each with a bias [E, out]). Checkpoints store them
in one of three layouts:

- transformers (float): `mlp.router.{weight,bias}`; `mlp.experts.gate_up_proj` [E, D, 2I] whose last axis holds
  gate and up INTERLEAVED (gate at even columns, up at odd), `gate_up_proj_bias` [E, 2I] alike,
  `down_proj` [E, I, D] and `down_proj_bias` [E, D] (x @ W orientation: transposed here);
- the hub's mxfp4 (openai/gpt-oss-*): the same names with `_blocks` (uint8 [E, rows, in / 32, 16], two e2m1
  values a byte) and `_scales` (uint8 e8m0 [E, rows, in / 32]) for the expert matrices, rows in [out, in]
  orientation, gate_up's rows interleaved; exactly MLX's mxfp4 once the bytes are read as uint32 words;
- mlx-lm's (mlx_lm.convert, float or quantized): `mlp.router.*` and `mlp.experts.{gate,up,down}_proj.*` stacked.
"""

from __future__ import annotations

import re
from dataclasses import replace

import mlx.core as mx

from ..errors import CheckpointError
from .args import ModelArgs
from .family import StoredTensors

EXPERTS = re.compile(r"^(?P<block>model\.layers\.\d+\.mlp)\.experts\.(?P<rest>[a-z_].*)$")  # not experts.{i}
ROUTER = re.compile(r"^(?P<block>model\.layers\.\d+\.mlp)\.router\.(?P<part>\w+)$")
MLX_LM = re.compile(r"^(?:gate|up|down)_proj\.\w+$")


def to_moebench_names(store: StoredTensors, args: ModelArgs) -> ModelArgs:
    """Rename (and for the transformers and hub layouts split and reorient) every gpt-oss router and expert tensor
    of `store` into moebench's names; a tensor of the wrong shape or type is a CheckpointError naming it. Returns
    `args` with the per-module quantization entries (mlx-lm keeps the router at 8 bits) under the same names."""
    if args.quantization is not None:
        overrides = {_module_name(path): spec for path, spec in args.quantization.overrides.items()}
        args = replace(args, quantization=replace(args.quantization, overrides=overrides))
    blocks: dict[str, dict[str, str]] = {}
    for name in list(store.names()):
        if (m := ROUTER.match(name)) is not None:
            store.rename(name, f"{m['block']}.gate.{m['part']}")
        elif (m := EXPERTS.match(name)) is not None:
            if MLX_LM.match(m["rest"]):
                store.rename(name, f"{m['block']}.switch_mlp.{m['rest']}")
            else:
                blocks.setdefault(m["block"], {})[m["rest"]] = name
    for block, stored in blocks.items():
        _fused_experts(store, block, stored)
    return args


def _module_name(path: str) -> str:
    """An mlx-lm module path in moebench's names: `...mlp.router` -> `...mlp.gate`, `...mlp.experts.up_proj` ->
    `...mlp.switch_mlp.up_proj`; any other path as it is."""
    path = re.sub(r"^(model\.layers\.\d+\.mlp)\.router$", r"\1.gate", path)
    return re.sub(r"^(model\.layers\.\d+\.mlp)\.experts\.((?:gate|up|down)_proj)$", r"\1.switch_mlp.\2", path)




def _fused_experts(store: StoredTensors, block: str, stored: dict[str, str]) -> None:
    """One block's transformers or hub expert tensors -> switch_mlp's gate, up and down."""
    out = f"{block}.switch_mlp"
    known = {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "gate_up_proj_blocks",
             "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales"}
    for rest, name in stored.items():
        if rest not in known:
            raise CheckpointError(f"{store.where(name)}: unexpected expert tensor {name}")
    for proj in ("gate_up_proj", "down_proj"):
        if proj in stored:
            weights = {"weight": _float(store, stored[proj], 3).swapaxes(1, 2)}  # x @ W -> [E, out, in]
        elif f"{proj}_blocks" in stored:
            weights = {"weight": _blocks(store, stored[f"{proj}_blocks"]),
                       "scales": _uint8(store, stored[f"{proj}_scales"] if f"{proj}_scales" in stored else
                                        _missing(store, f"{block}.experts.{proj}_scales"), 3)}
        else:
            raise CheckpointError(f"{store.folder}: missing tensor {block}.experts.{proj} (or {proj}_blocks)")
        bias_name = stored.get(f"{proj}_bias") or _missing(store, f"{block}.experts.{proj}_bias")
        weights["bias"] = _float(store, bias_name, 2)
        where = store.where(bias_name)
        if proj == "down_proj":
            for part, value in weights.items():
                store.put(f"{out}.down_proj.{part}", value, where)
            continue
        for part, value in weights.items():
            axis = 1 if part != "bias" else -1  # interleaved rows (weight, scales) or columns (bias)
            if value.shape[axis] % 2:
                raise CheckpointError(f"{where}: {block}.experts.gate_up_proj{'_bias' if part == 'bias' else ''} "
                                      f"has an odd gate/up width {value.shape[axis]}")
            gate, up = (mx.contiguous(value[:, i::2]) for i in (0, 1))
            store.put(f"{out}.gate_proj.{part}", gate, where)
            store.put(f"{out}.up_proj.{part}", up, where)


def _missing(store: StoredTensors, name: str) -> str:
    raise CheckpointError(f"{store.folder}: missing tensor {name}")


def _float(store: StoredTensors, name: str, ndim: int) -> mx.array:
    value = store.take(name)
    if value.ndim != ndim or not mx.issubdtype(value.dtype, mx.floating):
        raise CheckpointError(f"{store.where(name)}: {name} is {value.dtype} {tuple(value.shape)}, expected a "
                              f"floating point tensor of {ndim} axes")
    return value


def _uint8(store: StoredTensors, name: str, ndim: int) -> mx.array:
    value = store.take(name)
    if value.ndim != ndim or value.dtype != mx.uint8:
        raise CheckpointError(f"{store.where(name)}: {name} is {value.dtype} {tuple(value.shape)}, expected uint8 of "
                              f"{ndim} axes")
    return value


def _blocks(store: StoredTensors, name: str) -> mx.array:
    """Hub mxfp4 blocks uint8 [E, rows, groups, 16] -> MLX's packed words uint32 [E, rows, groups * 4]."""
    value = _uint8(store, name, 4)
    if value.shape[-1] != 16:
        raise CheckpointError(f"{store.where(name)}: {name} {tuple(value.shape)} must hold 16 bytes (32 fp4 values) "
                              "per block on its last axis")
    return mx.view(value, mx.uint32).reshape(*value.shape[:2], -1)
