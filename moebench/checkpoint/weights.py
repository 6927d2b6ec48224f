"""Filling a model's placeholder weights from a checkpoint's tensors: the one loader, and the layouts it reads.

A module's path in the model is its tensors' name in the checkpoint (`model.layers.0.self_attn.q_proj`
holds `model.layers.0.self_attn.q_proj.weight`, `.scales`, `.biases`, `.bias`), with one difference
of layout: routed experts are held stacked (`mlp.switch_mlp.{proj}`, [E, out, in]) and a checkpoint
may store them that way or one by one (`mlp.experts.{i}.{proj}`, as the Qwen1.5-MoE exports do).
`stack_experts` turns the second into the first; `per_expert_names` goes the other way, for writers.
`checkpoint_tensors` / `tensor_shapes` say what a checkpoint of a model holds, so its layout is
described by the model alone.

Every tensor is checked against the placeholder's shape and the config's quantization (each tensor's
bit width inferred from its shape, so mixed-precision exports load right) and raises a CheckpointError
naming it; nothing reaches MLX unchecked.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from itertools import groupby

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import CheckpointError, NonFiniteError
from ..models import family
from ..models.args import ModelArgs, Quantization, QuantizedParts
from ..models.layers import ColumnShard, Linear, QuantizedWeight, RMSNorm, RowShard
from ..models.switch import PROJECTIONS, ExpertShard, SwitchGLU
from .files import TensorStore
from .quant import make_parts

#MOVED QuantizedParts

PARTS = ("weight", "scales", "biases")
LAYOUTS = ("per-expert", "stacked")
EXPERTS = re.compile(r"^(?P<root>.+)\.switch_mlp\.(?P<proj>\w+)\.(?P<part>\w+)$")
PER_EXPERT = re.compile(r"^(?P<root>.+)\.experts\.(?P<i>\d+)\.(?P<proj>\w+)\.(?P<part>\w+)$")
SAMPLED_ABOVE = 1 << 20  # values of a float matrix that load checks on a sample of rows (finite_flags)
SAMPLED_ROWS = 64
LAYER_CHILD = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(?P<child>\w+)\.")


def load_weights(model: nn.Module, store: TensorStore, dtype: mx.Dtype, quantization: Quantization | None,
                 check_finite: bool = True) -> None:
    """Fill every weight of `model` from `store` in `dtype` (float weights, scales, biases, norms): decoder
    layer by layer, each evaluated before the next is read (a bounded peak of memory), then the rest. A tied
    output projection's stored copy is dropped, as transformers and mlx-lm drop it; leftover tensors are the
    caller's to report (TensorStore.check_all_used). With `check_finite`, a weight holding NaN or Inf is a
    NonFiniteError naming it (finite_flags: large float matrices sampled, the rest whole; evaluated with the
    weights, so the files are read once)."""
    trees = [(layer, f"model.layers.{i}") for i, layer in enumerate(model.layers)]
    for tree, prefix in trees:
        _load_tree(tree, prefix, store, dtype, quantization)
        _evaluate(tree, prefix, store, check_finite)
    rest = [(m, path) for path, m in _in_model_order(model)
            if isinstance(m, (QuantizedWeight, RMSNorm)) and not path.startswith("model.layers.")]
    for module, path in rest:
        _load_tree(module, path, store, dtype, quantization)
    if "lm_head" not in model:
        for part in (*PARTS, "bias"):
            store.take_optional(f"lm_head.{part}")
    for module, path in rest:
        _evaluate(module, path, store, check_finite)


def _evaluate(tree: nn.Module, prefix: str, store: TensorStore, check_finite: bool) -> None:
    flags = finite_flags(tree, prefix, full=False) if check_finite else {}
    mx.eval(tree.parameters(), list(flags.values()))
    for name, flag in flags.items():
        bad = flag.tolist()
        if bad is True or (isinstance(bad, list) and all(bad)):
            continue
        expert = f" (expert {bad.index(False)})" if isinstance(bad, list) else ""
        raise NonFiniteError(f"{store.where(name)}: tensor {name}{expert} holds NaN or Inf")


def finite_flags(tree: nn.Module, prefix: str = "", full: bool = True) -> dict[str, mx.array]:
    """{tensor name: lazy bool, True where it holds no NaN or Inf (one per expert of a stack)} for every weight
    under `tree` (whose path in the model is `prefix`): float weights, biases and norms, affine scales and
    biases, and the NaN / Inf codes of the fp modes (uint8 scales; mxfp8's e4m3 weights). The quantized weights
    of the other modes hold no such code. Without `full`, a float matrix of more than SAMPLED_ABOVE values is
    checked on SAMPLED_ROWS rows spread over it (what load does: checking a float checkpoint whole costs ~20% of
    its load on CPU, measured); everything else always whole.

    A float array is checked through its sum, which is NaN or Inf exactly when one of its values is (or when a
    sum of huge finite values overflows float32's range, which weights of 1e29 and more can do): one read of the
    array, where an elementwise isfinite costs several times that on CPU."""
    flags = {}
    for path, module in tree.named_modules():
        name = ".".join(p for p in (prefix, path) if p)
        if not isinstance(module, (QuantizedWeight, RMSNorm)):
            flags.update({f"{name}.{key}": _finite(module[key], key, None) for key in own_arrays(module)})
            continue
        mode = getattr(module, "mode", None)
        for part in (*PARTS, "bias"):
            if part not in module:
                continue
            array = module[part]
            if not full and mode is None and part == "weight" and isinstance(module, QuantizedWeight) and \
                    array.size > SAMPLED_ABOVE:
                array = array[..., :: -(-array.shape[-2] // SAMPLED_ROWS), :]
            if (flag := _finite(array, part, mode)) is not None:
                flags[f"{name}.{part}"] = flag
    return flags


def _finite(array: mx.array, part: str, mode: str | None) -> mx.array | None:
    """Whether the array (each expert of a stack [E, ...]) holds only finite values; None when it cannot hold NaN
    or Inf."""
    axes = tuple(range(1, array.ndim)) if array.ndim == 3 else None
    if mx.issubdtype(array.dtype, mx.floating):
        if array.dtype == mx.float16:  # its sum would overflow at 65504
            array = array.astype(mx.float32)
        return mx.isfinite(array.sum(axis=axes) if axes else array.sum())
    if part == "scales" and mode in ("mxfp4", "mxfp8"):
        bad = array == 0xFF  # e8m0: 0xFF is NaN
    elif (part, mode) in (("scales", "nvfp4"), ("weight", "mxfp8")):
        bad = (mx.view(array, mx.uint8) & 0x7F) == 0x7F  # e4m3: S1111111 is NaN
    else:
        return None
    return ~(bad.any(axis=axes) if axes else bad.any())


def nonfinite_weights(model: nn.Module) -> list[str]:
    """The names of the model's weights that hold NaN or Inf, every value of every weight read (load samples large
    float matrices; selfcheck's place). Its cost is timed by calling it on a loaded model, load's by loading with
    and without check_finite."""
    flags = finite_flags(model, full=True)
    mx.eval(list(flags.values()))
    return [name for name, flag in flags.items() if not flag.all().item()]


def _load_tree(tree: nn.Module, prefix: str, store: TensorStore, dtype: mx.Dtype,
               quantization: Quantization | None) -> None:
    """Every weight under `tree`, whose path in the model is `prefix`; expert stacks are made first."""
    modules = [(f"{prefix}.{path}" if path else prefix, m) for path, m in _in_model_order(tree)]
    for path, module in modules:
        if isinstance(module, ExpertShard):
            stack_experts(store, path, module.total, range(module.first, module.first + module.num_experts))
        elif isinstance(module, SwitchGLU):
            stack_experts(store, path, module.num_experts)
    for path, module in modules:
        if (held := getattr(module, "held_rows", None)) is not None:  # a rank's rows in several spans (sharding)
            keys = (*PARTS, "bias") if isinstance(module, QuantizedWeight) else own_arrays(module)
            narrow_tensors(store, path, keys, held.total, held.spans)
        if isinstance(module, RMSNorm):
            load_norm(store, path, module, dtype)
            continue
        kept = getattr(module, "float32_params", ())  # held in float32 whatever the activations' dtype
        for key in own_arrays(module):  # a linear layer's arrays beside its matrix too (a router's selection bias)
            if not isinstance(module, QuantizedWeight) or key not in (*PARTS, "bias"):
                load_array(store, f"{path}.{key}", module, key, mx.float32 if key in kept else dtype)
        if isinstance(module, ColumnShard):
            load_columns(store, path, module, dtype, quantization)
        elif isinstance(module, QuantizedWeight):
            if isinstance(module, RowShard):
                narrow_rows(store, path, module)
            load_weight(store, path, module, dtype, quantization)


def _in_model_order(tree: nn.Module) -> list[tuple[str, nn.Module]]:
    """tree.named_modules() with each module's children in the model's order (MLX lists the last first), so that
    a bad checkpoint is reported at its first bad tensor (q_proj before o_proj, gate_proj before down_proj)."""
    return tree.named_modules()[::-1]


def load_weight(store: TensorStore, name: str, module: QuantizedWeight, dtype: mx.Dtype,
                quantization: Quantization | None) -> None:
    """`{name}.weight` (+ scales/biases when quantized, + bias when the module has one) into `module`, checked
    against its shape; float weights in `dtype`, quantized ones with scales and biases in `dtype`."""
    expected = module.shape
    where = store.where(f"{name}.weight")
    weight, scales, biases = (store.take(f"{name}.weight"), store.take_optional(f"{name}.scales"),
                              store.take_optional(f"{name}.biases"))
    if len(expected) == 3 and weight.ndim == 3 and weight.shape[0] != expected[0]:
        raise CheckpointError(f"{where}: {name}.weight {tuple(weight.shape)} holds {weight.shape[0]} experts, "
                              f"config.json has {expected[0]} stacked experts")
    bias = store.take(f"{name}.bias") if "bias" in module else None
    if bias is not None:  # [out], or [E, out] for an expert stack
        if tuple(bias.shape) != expected[:-1]:
            raise CheckpointError(f"{store.where(name + '.bias')}: {name}.bias has shape {tuple(bias.shape)}, "
                                  f"expected {expected[:-1]}")
        if not mx.issubdtype(bias.dtype, mx.floating):
            raise CheckpointError(f"{store.where(name + '.bias')}: {name}.bias is {bias.dtype}, expected floating "
                                  "point")
        bias = bias.astype(dtype)
    if scales is None:
        if biases is not None:
            raise CheckpointError(f"{where}: {name}.biases present without scales")
        if tuple(weight.shape) != expected:
            raise CheckpointError(f"{where}: {name}.weight has shape {tuple(weight.shape)}, expected {expected}")
        if not mx.issubdtype(weight.dtype, mx.floating):
            raise CheckpointError(f"{where}: {name}.weight is {weight.dtype} without scales (unquantized weights "
                                  "must be floating point)")
        module.set_weight(weight.astype(dtype), bias=bias)
        return
    spec = quantization.for_module(name) if quantization else None
    if spec is None:
        raise CheckpointError(f"{store.where(name + '.scales')}: {name} is quantized but config.json has no "
                              "quantization for it")
    if weight.ndim != len(expected):
        raise CheckpointError(f"{where}: {name}.weight has {weight.ndim} axes {tuple(weight.shape)}, expected "
                              f"{len(expected)} ({expected} before packing)")
    parts = make_parts(f"{where}: {name}", weight, scales, biases, spec, scale_dtype=dtype)
    found = (*weight.shape[:-1], parts.in_features)
    if found != expected:
        raise CheckpointError(f"{where}: {name} holds {parts.bits}-bit weights of {found}, expected {expected}")
    module.set_weight(parts.weight, parts, bias)


def narrow_rows(store: TensorStore, name: str, module: RowShard) -> None:
    """Keep only a RowShard's rows of `{name}.weight` (+ scales, biases, bias) in the store, read alone."""
    narrow_tensors(store, name, (*PARTS, "bias"), module.total, ((module.first, module.first + module.shape[0]),))


def narrow_tensors(store: TensorStore, name: str, keys: tuple[str, ...] | list[str], total: int,
                   spans: tuple[tuple[int, int], ...]) -> None:
    """Keep only the rows of `spans` of each stored `{name}.{key}` (of `total` rows, or a CheckpointError), read
    alone."""
    for key in keys:
        tensor = f"{name}.{key}"
        if tensor not in store:
            continue
        rows = store.peek(tensor).shape
        if not rows or rows[0] != total:
            raise CheckpointError(f"{store.where(tensor)}: {tensor} {tuple(rows)} holds {rows[0] if rows else 0} "
                                  f"rows, config.json gives {total}")
        store.narrow_spans(tensor, spans)


def load_columns(store: TensorStore, name: str, module: ColumnShard, dtype: mx.Dtype,
                 quantization: Quantization | None) -> None:
    """A ColumnShard's input columns of `{name}`: the whole matrix is read and checked as an unsharded one is, then
    only the rank's columns kept (a quantized matrix is cut at group boundaries, or it is a CheckpointError)."""
    out_features, width = module.shape
    whole = Linear(module.total, out_features, bias="bias" in module)
    load_weight(store, name, whole, dtype, quantization)
    first, end = module.first, module.first + width
    parts, bias = whole.quantized_parts(), whole.get("bias")
    if parts is None:
        module.set_weight(mx.contiguous(whole["weight"][:, first:end]), bias=bias)
        return
    step = math.lcm(parts.group_size, 32 // math.gcd(32, parts.bits))  # a column where a group and a word start
    if first % step or end % step:
        raise CheckpointError(f"{store.where(name + '.weight')}: {name}: this rank's input columns {first}..{end - 1} "
                              f"cut its {parts.bits}-bit groups of {parts.group_size}; the heads cannot split there")
    words, groups = slice(first * parts.bits // 32, end * parts.bits // 32), \
        slice(first // parts.group_size, end // parts.group_size)
    cut = QuantizedParts(mx.contiguous(parts.weight[:, words]), mx.contiguous(parts.scales[:, groups]),
                         None if parts.biases is None else mx.contiguous(parts.biases[:, groups]),
                         parts.group_size, parts.bits, parts.mode)
    module.set_weight(cut.weight, cut, bias)


def own_arrays(module: nn.Module) -> list[str]:
    """The parameters a module holds itself, not through a child (gpt-oss attention's `sinks`); as MLX's
    parameters(), a name starting with '_' is not one."""
    return [key for key, value in module.items() if isinstance(value, mx.array) and not key.startswith("_")]


def load_array(store: TensorStore, name: str, module: nn.Module, key: str, dtype: mx.Dtype) -> None:
    """The float tensor `name` into `module[key]`, checked against its shape."""
    w, size = store.take(name), tuple(module[key].shape)
    if tuple(w.shape) != size:
        raise CheckpointError(f"{store.where(name)}: {name} has shape {tuple(w.shape)}, expected {size}")
    if not mx.issubdtype(w.dtype, mx.floating):
        raise CheckpointError(f"{store.where(name)}: {name} is {w.dtype}, expected floating point")
    module[key] = w.astype(dtype)


def load_norm(store: TensorStore, name: str, module: RMSNorm, dtype: mx.Dtype) -> None:
    """`{name}.weight` into an RMSNorm, checked against its size."""
    w = store.take(f"{name}.weight")
    where, size = store.where(f"{name}.weight"), module.weight.shape
    if tuple(w.shape) != tuple(size):
        raise CheckpointError(f"{where}: {name}.weight has shape {tuple(w.shape)}, expected {tuple(size)}")
    if not mx.issubdtype(w.dtype, mx.floating):
        raise CheckpointError(f"{where}: {name}.weight is {w.dtype}, expected floating point")
    module.weight = w.astype(dtype)


def stack_experts(store: TensorStore, root: str, num_experts: int, held: range | None = None) -> None:
    """Make `{root}.switch_mlp.{proj}.*` available in the store: stored so already, or stacked from
    `{root}.experts.{i}.{proj}.*` for i in 0..E-1 (a hole, an extra or a ragged expert is an error; an
    expert stored both ways too). With `held` (a rank's span of experts, moebench.models.sharding) only those
    experts: rows of a stored stack read alone, the other per-expert tensors taken and never read."""
    block = root.removesuffix(".switch_mlp")
    held = held if held is not None else range(num_experts)
    split_fused_experts(store, block)
    for proj in PROJECTIONS:
        stacked = f"{block}.switch_mlp.{proj}"
        pattern = re.compile(re.escape(f"{block}.experts.") + r"(\d+)\." + re.escape(proj) + r"\.(\w+)$")
        found: dict[str, dict[int, str]] = {}
        for name in list(store.names()):
            m = pattern.match(name)
            if m:
                found.setdefault(m.group(2), {})[int(m.group(1))] = name
        if f"{stacked}.weight" in store:
            if found:
                first = next(iter(next(iter(found.values())).values()))
                raise CheckpointError(f"{store.where(first)}: {first} duplicates the stacked {stacked}")
            if len(held) < num_experts:
                for part in (*PARTS, "bias"):  # "bias": experts with biases (gpt-oss), [E, out]
                    if f"{stacked}.{part}" in store:
                        _narrow_stack(store, f"{stacked}.{part}", num_experts, held)
            continue
        if "weight" not in found:
            raise CheckpointError(f"{store.folder}: missing tensor {stacked}.weight (and no per-expert "
                                  f"{block}.experts.0.{proj}.weight)")
        for suffix, by_index in sorted(found.items()):
            if suffix not in PARTS:
                raise CheckpointError(f"{store.where(by_index[min(by_index)])}: unexpected expert tensor "
                                      f"{by_index[min(by_index)]}")
            missing = next((i for i in range(num_experts) if i not in by_index), None)  # stops at the first
            if missing is not None:
                raise CheckpointError(f"{store.folder}: missing tensor {block}.experts.{missing}.{proj}.{suffix} "
                                      f"(config has {num_experts} experts)")
            extra = sorted(i for i in by_index if i >= num_experts)
            if extra:
                raise CheckpointError(f"{store.where(by_index[extra[0]])}: unexpected tensor {by_index[extra[0]]} "
                                      f"(config has {num_experts} experts)")
            parts = [store.take(by_index[i]) for i in range(num_experts)]
            for i, p in enumerate(parts):
                if p.shape != parts[0].shape or p.dtype != parts[0].dtype:
                    raise CheckpointError(
                        f"{store.where(by_index[i])}: ragged expert {by_index[i]}: {tuple(p.shape)} {p.dtype}, "
                        f"expert 0 has {tuple(parts[0].shape)} {parts[0].dtype}")
            store.put(f"{stacked}.{suffix}", mx.stack(parts[held.start:held.stop]), store.where(by_index[0]))
            del parts


def split_fused_experts(store: TensorStore, block: str) -> None:
    """A block's experts as transformers 5 fuses them for any family (`save_pretrained(...,
    save_original_format=False)`, and Qwen3.5's hub folders): `experts.gate_up_proj` [E, 2I, D] (each expert's
    gate rows, then its up rows) and `experts.down_proj` [E, D, I], put in the store as switch_mlp's stacked gate,
    up and down weights. Nothing to do when the block stores neither."""
    gate_up, down = f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"
    if gate_up not in store and down not in store:
        return
    for name, other in ((gate_up, down), (down, gate_up)):
        if name not in store:
            raise CheckpointError(f"{store.where(other)}: missing tensor {name} (the block stores {other})")
        value = store.peek(name)
        if value.ndim != 3 or not mx.issubdtype(value.dtype, mx.floating):
            kind = str(value.dtype).removeprefix("mlx.core.")
            raise CheckpointError(f"{store.where(name)}: {name} is {kind} {tuple(value.shape)}, expected a floating "
                                  "point tensor of 3 axes")
    where, value = store.where(gate_up), store.take(gate_up)
    if value.shape[1] % 2:
        raise CheckpointError(f"{where}: {gate_up} {tuple(value.shape)} has an odd gate/up width {value.shape[1]}")
    width = value.shape[1] // 2
    store.put(f"{block}.switch_mlp.gate_proj.weight", mx.contiguous(value[:, :width]), where)
    store.put(f"{block}.switch_mlp.up_proj.weight", mx.contiguous(value[:, width:]), where)
    store.rename(down, f"{block}.switch_mlp.down_proj.weight")


def _narrow_stack(store: TensorStore, name: str, num_experts: int, held: range) -> None:
    stored = store.peek(name).shape
    if not stored or stored[0] != num_experts:
        raise CheckpointError(f"{store.where(name)}: {name} {tuple(stored)} holds {stored[0] if stored else 0} "
                              f"experts, config.json has {num_experts}")
    store.narrow(name, held.start, held.stop)


def per_expert_names(name: str, num_experts: int) -> list[str]:
    """A stacked expert tensor's names in the per-expert layout (`...switch_mlp.gate_proj.weight` ->
    `...experts.{i}.gate_proj.weight`), or [name] for any other tensor."""
    m = EXPERTS.match(name)
    if m is None:
        return [name]
    return [f"{m['root']}.experts.{i}.{m['proj']}.{m['part']}" for i in range(num_experts)]


def stacked_name(name: str) -> tuple[str, int] | None:
    """A per-expert tensor's stacked name and expert index (`...experts.3.up_proj.weight` ->
    (`...switch_mlp.up_proj.weight`, 3)), or None for any other tensor."""
    m = PER_EXPERT.match(name)
    if m is None:
        return None
    return f"{m['root']}.switch_mlp.{m['proj']}.{m['part']}", int(m["i"])


def checkpoint_tensors(model: nn.Module, layout: str = "per-expert") -> Iterator[tuple[str, mx.array]]:
    """The model's arrays under their checkpoint names, in file order: routed experts stacked, or split
    expert by expert (each its gate, up and down, as transformers saves them) in the per-expert layout.

    Each decoder layer's norms come first: the order moebench's writers have always used, which the
    random draws of seeded checkpoints (and the shipped model's training start) depend on."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    first: dict[str, int] = {}  # each layer's first position in the model's order

    def file_order(item: tuple[int, tuple[str, mx.array]]) -> tuple[int, int, int]:
        i, (name, _) = item
        m = LAYER_CHILD.match(name)
        if m is None:
            return i, 0, i
        return first.setdefault(m["layer"], i), 0 if m["child"].endswith("_layernorm") else 1, i

    ordered = [item for _, item in sorted(enumerate(tree_flatten(model.parameters())), key=file_order)]
    if layout == "stacked":
        yield from ordered
        return
    for root, group in groupby(ordered, key=lambda item: (m := EXPERTS.match(item[0])) and m["root"]):
        group = list(group)
        if not root:
            yield from group
            continue
        num_experts = group[0][1].shape[0]
        names = [per_expert_names(name, num_experts) for name, _ in group]
        for e in range(num_experts):
            for (_, value), split in zip(group, names, strict=True):
                yield split[e], value[e]


def tensor_shapes(args: ModelArgs, layout: str = "per-expert") -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a float checkpoint of `args`, with its shape, in file order (checkpoint_tensors of the
    model built from args: its placeholders are never computed)."""
    model = family(args.model_type).model(args)
    return [(name, tuple(value.shape)) for name, value in checkpoint_tensors(model, layout)]
