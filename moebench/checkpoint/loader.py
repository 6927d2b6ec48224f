"""moebench.load(): a checkpoint folder -> (model, tokenizer), with a report of the bits found per module."""

from __future__ import annotations

import os
import re
import textwrap
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import CheckpointError, ConfigError
from ..models import family
from ..models.args import ModelArgs
from ..models.layers import QuantizedWeight
from ..models.sharding import shard_experts, shard_heads, shard_mlps
from ..units import byte_size
from .config import GENERATION_CONFIG, GenerationConfig, read_model_args
from .files import TensorStore, is_present
from .tokenizer import Tokenizer
from .weights import load_weights

ACTIVATION_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
SHIPPED_MODEL = Path(str(resources.files("moebench") / "shipped" / "tiny-qwen2-moe"))  # data/, in the wheel too
ENV_MODEL = "MOEBENCH_MODEL"


@dataclass(frozen=True)
class LoadInfo:
    """Where a model came from, the quantization found per module kind, and the stored tensors left out on purpose
    (why -> how many: a multimodal folder's vision tower)."""

    source: Path
    bits: dict[str, str]
    skipped: dict[str, int] = field(default_factory=dict)


def default_model_path() -> Path:
    """MOEBENCH_MODEL when set (its first folder, when it lists several as the notebooks' model picker takes
    them, separated by os.pathsep), else the tiny trained model that ships in data/. A folder it names that holds
    no config.json is a ConfigError naming the variable: the command that read it was given no path."""
    named = [p for p in os.environ.get(ENV_MODEL, "").split(os.pathsep) if p.strip()]
    if not named:
        return SHIPPED_MODEL
    folder = Path(named[0])
    if not (folder / "config.json").is_file():
        why = ("does not exist" if not folder.exists() else "is not a folder" if not folder.is_dir()
               else "holds no config.json")
        raise ConfigError(f"{ENV_MODEL}={os.environ[ENV_MODEL]!r}: {folder} {why}; set it to a checkpoint folder "
                          f"(several separated by {os.pathsep!r}), or unset it for the shipped model")
    return folder


def default_dtype() -> mx.Dtype | None:
    """float32 on CPU (half-precision quantized matmul is slow and inexact there); None = checkpoint's dtype."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def _checkpoint_dtype(store: TensorStore) -> mx.Dtype:
    """The first float weight's or scale's dtype; float32 for a float64 checkpoint (GPUs have no float64)."""
    for name in store.names():
        if name.endswith((".scales", ".weight")):
            arr = store.peek(name)
            if mx.issubdtype(arr.dtype, mx.floating):
                return arr.dtype if arr.dtype in ACTIVATION_DTYPES else mx.float32
    return mx.float32


def _check_layer_count(args: ModelArgs, store: TensorStore, folder: Path) -> None:
    """More layers in config.json than the checkpoint stores is an error before the model is built (building a
    million placeholder layers would take minutes and gigabytes before the first missing tensor is named)."""
    stored = 1 + max((int(m[1]) for n in store.names() if (m := re.match(r"model\.layers\.(\d+)\.", n))), default=-1)
    if args.num_hidden_layers > stored:
        raise CheckpointError(f"{folder}: config.json has num_hidden_layers {args.num_hidden_layers} but the "
                              f"checkpoint stores {stored} (missing tensor model.layers.{stored}.*)")


def _check_eos_ids(args: ModelArgs, folder: Path) -> None:
    """Every eos id of config.json and generation_config.json (args.eos_token_id holds both) is one the model can
    produce: an id past its vocabulary would never stop a decode, so it is a ConfigError naming the file and field."""
    extra = GenerationConfig.from_file(folder / GENERATION_CONFIG).eos_token_id
    for token_id in args.eos_token_id:
        if not 0 <= token_id < args.vocab_size:
            source = GENERATION_CONFIG if token_id in extra else "config.json"
            raise ConfigError(f"{folder / source}: field 'eos_token_id' names id {token_id}, outside the model's "
                              f"vocabulary of {args.vocab_size} (config.json vocab_size)")


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def bits_report(model: nn.Module) -> dict[str, str]:
    """Module kind (layer index dropped) -> the quantization found, e.g. {'mlp.switch_mlp.down_proj': '8-bit g64'}."""
    found: dict[str, set[str]] = defaultdict(set)
    for path, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            kind = re.sub(r"^model\.(layers\.\d+\.)?", "", path)
            if module.quant is None:
                found[kind].add(f"float {module.weight.dtype}".replace("mlx.core.", ""))
            else:
                gs, bits, mode = module.quant
                found[kind].add(f"{bits}-bit g{gs}" + ("" if mode == "affine" else f" {mode}"))
    return {k: ", ".join(sorted(v)) for k, v in sorted(found.items())}


def model_bytes(model: nn.Module) -> int:
    """The bytes of a model's weights (moebench's or mlx-lm's: both hold them as MLX arrays)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def quantization_text(bits: dict[str, str]) -> str:
    """A bits_report in a few words: the quantization most module kinds have, and how many have each other one
    ('4-bit g64 (2 module kinds 8-bit g64)'). Which kinds is load_details' to say."""
    (main, _), *others = Counter(bits.values()).most_common()
    rest = ", ".join(f"{n} module kind{'s' if n > 1 else ''} {value}" for value, n in others)
    return f"{main} ({rest})" if rest else main


def load_summary(model: nn.Module) -> str:
    """One short line a person reads when a command opens a checkpoint: folder name, family, layers,
    experts and top-k, quantization and the weights' size."""
    a, info = model.args, model.load_info
    skipped = "".join(f"; left out {n} tensors of the {why}" for why, n in info.skipped.items())
    return (f"loaded {info.source.name}: {a.model_type}, {a.num_hidden_layers} layers, {a.num_experts} experts "
            f"top-{a.num_experts_per_tok}, {quantization_text(info.bits)}, {byte_size(model_bytes(model))}{skipped}")


def quantization_details(bits: dict[str, str]) -> list[str]:
    """A bits_report grouped by quantization, one line each: '8-bit g64: mlp.gate, mlp.shared_expert_gate'."""
    kinds: dict[str, list[str]] = defaultdict(list)
    for kind, value in bits.items():
        kinds[value].append(kind)
    return [f"{value}: {', '.join(names)}" for value, names in kinds.items()]


def load_details(model: nn.Module) -> str:
    """What load_summary leaves out: the full path and the quantization of every module kind."""
    info = model.load_info
    lines = [str(info.source), *quantization_details(info.bits)]
    return "\n".join(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
                     for line in lines)


def load(path: str | Path | None = None, dtype: mx.Dtype | None = None, progress: bool | None = None,
         verbose: bool = False, check_finite: bool = True, shard: mx.distributed.Group | None = None,
         tensor_parallel: bool = False):
    """Open a checkpoint folder (config.json, safetensors, tokenizer.json) -> (model, tokenizer or None).

    With no path, MOEBENCH_MODEL or the shipped tiny model. Activations run in float32 on CPU and in
    the checkpoint's dtype on GPU unless `dtype` (float32, float16 or bfloat16) says otherwise.
    `check_finite`: a weight holding NaN or Inf is a NonFiniteError naming it (False skips the check, e.g. to
    time it; checkpoint.weights.nonfinite_weights runs it on a loaded model). `shard`: an mx.distributed group
    over which the routed experts are split (moebench.models.sharding); this process reads only its own.
    `tensor_parallel`: split every layer's attention heads and every shared expert's and dense MLP's width over
    `shard` too (mode experts+tensor).
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"load: path must be a folder name (str or Path), got {type(path).__name__}")
    if dtype is not None and dtype not in ACTIVATION_DTYPES:
        raise ConfigError(f"load: dtype must be one of {', '.join(map(_name, ACTIVATION_DTYPES))} or None, got "
                          f"{dtype!r}")
    folder = Path(path) if path is not None else default_model_path()
    if not folder.exists():
        raise ConfigError(f"{folder}: does not exist")
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a checkpoint folder")
    args = read_model_args(folder / "config.json")
    _check_eos_ids(args, folder)
    store = TensorStore(folder, progress=progress)
    declared = family(args.model_type, str(folder / "config.json"))
    if declared.stored_layout is not None:  # the family's published names and shapes, as its modules hold them
        args = declared.stored_layout(store, args)
    _check_layer_count(args, store, folder)
    model = declared.model(args)
    if shard is not None:
        if not isinstance(shard, mx.distributed.Group):
            raise ConfigError(f"load: shard must be an mx.distributed.Group or None, got {type(shard).__name__}")
        shard_experts(model, shard)
        if tensor_parallel:
            shard_heads(model, shard)
            shard_mlps(model, shard)
    elif tensor_parallel:
        raise ConfigError("load: tensor_parallel needs a shard (an mx.distributed.Group) to split the layers over")
    load_weights(model, store, dtype or default_dtype() or _checkpoint_dtype(store), args.quantization,
                 check_finite)
    store.check_all_used()
    model.load_info = LoadInfo(folder, bits_report(model), dict(store.skipped))
    if verbose:
        print(load_summary(model))
    tok_path = folder / "tokenizer.json"  # plus the other tokenizer files; ids checked against the vocabulary
    tokenizer = Tokenizer.from_folder(folder, args.vocab_size, verbose) if is_present(tok_path) else None
    return model, tokenizer
