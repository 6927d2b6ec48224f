"""Writing checkpoint folders: random weights of any moebench family in the HF float layout, MLX quantization in
the stacked or per-expert layout, and sharded safetensors with an index. Used by tests, by
`moebench make-random` and by training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..checkpoint.config import model_args
from ..checkpoint.weights import LAYOUTS, stacked_name, tensor_shapes
from ..decode.sampling import check_seed
from ..models import family, qwen2_moe
from ..models.args import ModelArgs
from ..models.switch import PROJECTIONS

# gpt-oss as mlx-lm's convert writes it and mlx-community publishes it (e.g. gpt-oss-20b-MXFP4-Q8): the router at
# `mlp.router` in 8-bit affine groups of 64 (mlx-lm's gpt_oss quant_predicate), the experts stacked at
# `mlp.experts.{gate,up,down}_proj` in mxfp4 as the hub ships them, each named in config.json's quantization
GPT_OSS_EXPERTS = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
GPT_OSS_ROUTER = {"group_size": 64, "bits": 8, "mode": "affine"}
_GPT_OSS_NAMES = ((re.compile(r"^(model\.layers\.\d+\.mlp)\.gate\.(\w+)$"), r"\1.router.\2"),
                  (re.compile(r"^(model\.layers\.\d+\.mlp)\.switch_mlp\.(\w+)\.(\w+)$"), r"\1.experts.\2.\3"))


def _scaled(name: str, shape: tuple[int, ...], z):
    """Standard normals z (numpy or MLX) -> weights that keep activations in range: norms near 1,
    biases small, matrices ~ N(0, 1/fan_in)."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * z
    if name.endswith(".bias"):
        return 0.02 * z
    return z / np.sqrt(shape[-1])


def random_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator, dtype=mx.float32) -> mx.array:
    """Small random weights that keep activations in range: norms near 1, matrices ~ N(0, 1/fan_in)."""
    return mx.array(_scaled(name, shape, rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def random_tensors(
    args: ModelArgs, seed: int = 0, dtype=mx.float32, generator: str = "numpy"
) -> Iterator[tuple[str, mx.array]]:
    """One random tensor at a time. generator 'mlx' draws on MLX's default device (a real-size model
    in seconds on a GPU, where numpy takes minutes); its values differ from 'numpy''s for the same seed."""
    if generator == "mlx":
        key = mx.random.key(seed)
        for name, shape in tensor_shapes(args):
            key, sub = mx.random.split(key)
            yield name, _scaled(name, shape, mx.random.normal(shape, key=sub)).astype(dtype)
        return
    if generator != "numpy":
        raise ValueError(f"generator must be 'numpy' or 'mlx', got {generator!r}")
    rng = np.random.default_rng(seed)
    for name, shape in tensor_shapes(args):
        yield name, random_tensor(name, shape, rng, dtype)


def quantize_tensors(
    tensors: Iterator[tuple[str, mx.array]],
    group_size: int = 64,
    bits: int | Callable[[str], int] = 4,
    layout: str = "per-expert",
    num_experts: int | None = None,
    skip: Callable[[str], bool] = lambda name: False,
    mode: str = "affine",
) -> Iterator[tuple[str, mx.array]]:
    """MLX quantization in `mode` of every 2-D weight whose input width divides by the group size.

    `bits` may be a function of the tensor name (mixed precision). layout 'stacked' gathers each
    layer's experts into `mlp.switch_mlp.{proj}` (needs num_experts); 'per-expert' keeps `experts.{i}`.
    The microscaled modes (mxfp4, nvfp4, mxfp8) write uint8 scales and no biases, as mlx_lm.convert does.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    pending: dict[str, dict[int, mx.array]] = {}
    for name, w in tensors:
        quantizable = w.ndim == 2 and w.shape[-1] % group_size == 0 and not skip(name)
        expert = stacked_name(name) if layout == "stacked" else None
        if expert is not None:
            name, index = expert
            pending.setdefault(name, {})[index] = w
            if len(pending[name]) < num_experts:
                continue
            by_index = pending.pop(name)
            if sorted(by_index) != list(range(num_experts)):
                raise ValueError(f"{name}: experts {sorted(by_index)}, expected 0..{num_experts - 1}")
            w = mx.stack([by_index[i] for i in range(num_experts)])  # by index: files list expert 10 before 2
        if not quantizable:
            yield name, w
            continue
        b = bits(name) if callable(bits) else bits
        base = name[: -len(".weight")]
        for part, value in zip(("weight", "scales", "biases"), mx.quantize(w, group_size, b, mode=mode), strict=False):
            yield f"{base}.{part}", value
    if pending:
        raise ValueError(f"incomplete expert stacks: {sorted(pending)}")


def save_checkpoint(
    folder: str | Path, config: dict, tensors: Iterator[tuple[str, mx.array]], shard_bytes: int | None = None
) -> Path:
    """Write config.json and the tensors (sharded with model.safetensors.index.json past shard_bytes)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards: list[list[str]] = []  # the tensor names of each shard written so far
    pending: dict[str, mx.array] = {}

    def flush() -> None:
        mx.save_safetensors(str(folder / f"shard-{len(shards) + 1:05d}.tmp.safetensors"), pending)
        shards.append(list(pending))
        pending.clear()

    size = 0
    for name, arr in tensors:
        mx.eval(arr)
        if shard_bytes and pending and size + arr.nbytes > shard_bytes:
            flush()
            size = 0
        pending[name] = arr
        size += arr.nbytes
    flush()
    n = len(shards)
    if n == 1:
        (folder / "shard-00001.tmp.safetensors").rename(folder / "model.safetensors")
        return folder
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        final_name = f"model-{i:05d}-of-{n:05d}.safetensors"
        (folder / f"shard-{i:05d}.tmp.safetensors").rename(folder / final_name)
        weight_map.update({name: final_name for name in names})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return folder


def qwen2_moe_config(**overrides) -> dict:
    """An HF-style qwen2_moe config.json dict (the family's tiny config, every computation field present)."""
    return {**qwen2_moe.TINY_CONFIG, **overrides}


def kept_float(args: ModelArgs) -> Callable[[str], bool]:
    """Whether a tensor stays float as the family's MLX conversions keep it (its declared `unquantized` endings)."""
    kept = family(args.model_type).unquantized
    return lambda name: bool(kept) and name.endswith(kept)


def write_random_checkpoint(
    folder: str | Path,
    config: dict,
    seed: int = 0,
    bits: int | Callable[[str], int] | None = None,
    group_size: int = 64,
    layout: str = "per-expert",
    shard_bytes: int | None = None,
    dtype=mx.float32,
) -> Path:
    """A random checkpoint: float HF layout when bits is None, else MLX-quantized in `layout`."""
    check_seed(seed)
    args = model_args(config)
    tensors = random_tensors(args, seed, dtype)
    if bits is not None:
        tensors = quantize_tensors(tensors, group_size, bits, layout, args.num_experts, skip=kept_float(args))
        config = {**config, "quantization": {"group_size": group_size,
                                             "bits": bits if isinstance(bits, int) else 4, "mode": "affine"}}
    return save_checkpoint(folder, config, tensors, shard_bytes)


def gpt_oss_mlx_lm_name(name: str) -> str:
    """moebench's name of a gpt-oss tensor -> mlx-lm's: `mlp.gate.*` -> `mlp.router.*`, `mlp.switch_mlp.*` ->
    `mlp.experts.*`; any other name as it is."""
    for pattern, replacement in _GPT_OSS_NAMES:
        name = pattern.sub(replacement, name)
    return name


def gpt_oss_quantization(args: ModelArgs, group_size: int, bits: int) -> dict:
    """config.json's `quantization` of a gpt_oss_mlx_lm_tensors folder: affine `bits` / `group_size` for every
    module but the router and the experts, which name their own (mlx-lm reads such per-module entries)."""
    quantization: dict = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for i in range(args.num_hidden_layers):
        quantization[f"model.layers.{i}.mlp.router"] = dict(GPT_OSS_ROUTER)
        quantization.update({f"model.layers.{i}.mlp.experts.{p}": dict(GPT_OSS_EXPERTS) for p in PROJECTIONS})
    return quantization


def gpt_oss_mlx_lm_tensors(tensors: Iterator[tuple[str, mx.array]], args: ModelArgs, group_size: int,
                           bits: int) -> Iterator[tuple[str, mx.array]]:
    """A gpt-oss float checkpoint's tensors (moebench's per-expert names, as random_tensors draws them) in mlx-lm's
    layout (gpt_oss_quantization says how each is quantized), one at a time."""
    own = {"router": GPT_OSS_ROUTER, "experts": GPT_OSS_EXPERTS}
    stacked = quantize_tensors(tensors, group_size, bits, "stacked", args.num_experts,
                               skip=lambda name: ".mlp." in name)
    for name, w in stacked:
        name = gpt_oss_mlx_lm_name(name)
        spec = next((q for part, q in own.items() if f".mlp.{part}." in name), None)
        if spec is None or not name.endswith(".weight"):
            yield name, w
            continue
        base = name.removesuffix(".weight")
        for part, value in zip(("weight", "scales", "biases"), mx.quantize(w, **spec), strict=False):
            yield f"{base}.{part}", value


def write_gpt_oss_mlx_lm_checkpoint(folder: str | Path, config: dict, seed: int = 0, group_size: int = 32,
                                    bits: int = 4) -> Path:
    """A random gpt-oss checkpoint of `config` in mlx-lm's layout (gpt_oss_mlx_lm_tensors: mxfp4 experts, an 8-bit
    router, affine `bits` / `group_size` elsewhere), with its quantization in config.json."""
    args = model_args(config)
    config = {**config, "quantization": gpt_oss_quantization(args, group_size, bits)}
    return save_checkpoint(folder, config, gpt_oss_mlx_lm_tensors(random_tensors(args, seed), args, group_size, bits))
