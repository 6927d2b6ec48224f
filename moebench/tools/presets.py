"""Named model shapes, and `moebench make-random`: random-weight checkpoints at those shapes.

Real-size presets copy published configs, so a random checkpoint has the real model's tensor names, shapes
and shard structure, with its experts laid out as the family's MLX checkpoints lay them out, and benchmarks run
at real size with nothing to download. Each family declares its presets in its own model file.
Small presets keep every code path (GQA, shared expert, widths the fused kernel supports) at CPU sizes.
Weights stream through moebench.tools.writer one tensor at a time: generated, quantized, written to the
current shard; the float model is never whole in memory.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import mlx.core as mx

from ..checkpoint.config import model_args
from ..checkpoint.weights import LAYOUTS, tensor_shapes
from ..decode.sampling import check_seed
from ..errors import ConfigError
from ..models import families, family
from ..models.args import AFFINE_BITS, AFFINE_GROUP_SIZES, FP_MODES
from ..models.family import Preset
from .byte_tokenizer import check_vocabulary, write_byte_tokenizer
from .flags import SEED, finite, finite_number
from .progress import Progress
from .writer import (
    gpt_oss_mlx_lm_tensors,
    gpt_oss_quantization,
    kept_float,
    quantize_tensors,
    random_tensors,
    save_checkpoint,
)

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
DEFAULT_SHARD_GB = 5.0  # mlx-lm's shard size
EXPERT_NAMES = {"stacked": "mlp.switch_mlp.*", "per-expert": "mlp.experts.{i}.*"}
GPT_OSS_EXPERT_NAMES = "mlp.experts.{gate,up,down}_proj.* in mxfp4, router mlp.router.* in 8 bits"


# every family's named shapes (each declares its own: moebench.models.family)
PRESETS = {p.name: p for declared in dict.fromkeys(families().values()) for p in declared.presets}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def default_layout(preset: str) -> str:
    """The expert layout of the preset's family's MLX checkpoints, so mlx-lm loads what make-random writes as it
    loads the checkpoints people run (the family's declared expert_layout)."""
    return family(get_preset(preset).config["model_type"]).expert_layout


def parameter_counts(config: dict) -> tuple[int, int]:
    """(total, active per token) parameters of a config of any family: active counts top-k of each MoE layer's
    routed experts (all of one size), read off the float checkpoint's tensors."""
    args = model_args(config)
    total = routed = 0
    for name, shape in tensor_shapes(args):
        n = math.prod(shape)
        total += n
        if ".experts." in name:
            routed += n
    return total, total - routed + routed * args.num_experts_per_tok // max(args.num_experts, 1)


def cut_to(config: dict, layers: int | None, source: str) -> dict:
    """`config` with its first `layers` decoder layers (None: all of them), each as the whole model has it: a
    per-layer list (layer_types) cut with it, the MLP-only layer indices past the cut dropped. A checkpoint cut to
    fit a machine keeps every per-layer shape, so a decode step's per-layer cost is the whole model's."""
    if layers is None:
        return config
    whole = config["num_hidden_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= whole:
        raise ConfigError(f"layers {layers!r}: {source} has {whole} decoder layers; keep 1 to {whole} of them")
    cut = {**config, "num_hidden_layers": layers}
    if isinstance(config.get("layer_types"), list):
        cut["layer_types"] = config["layer_types"][:layers]
    if isinstance(config.get("mlp_only_layers"), list):
        cut["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    return cut


def write_random(
    out_dir: str | Path, preset: str, bits: int = 4, group_size: int = 64, dtype: str = "bfloat16", seed: int = 0,
    shard_gb: float = DEFAULT_SHARD_GB, generator: str = "mlx", progress: bool = True, layout: str | None = None,
    mode: str = "affine", layers: int | None = None,
) -> Path:
    """A random checkpoint of `preset`: MLX affine `bits`/`group_size` (or every quantized weight in a microscaled
    `mode`, whose bits and group size are the mode's, as `mlx_lm.convert --q-mode` writes it), experts in `layout`
    ('stacked' or 'per-expert'; default the family's, default_layout), scales in `dtype`, shards of at most
    `shard_gb` GB with an index, and a byte-level tokenizer of the preset's vocabulary (byte_tokenizer), so text
    prompts encode and every token decodes. Both layouts of one seed hold the same model. gpt-oss is written as
    mlx-lm lays it out (its router and mxfp4 experts under their own quantization, stacked only). `layers`: only
    the preset's first so many decoder layers (cut_to), for a model larger than the machine's disk or memory."""
    p = get_preset(preset)
    layout = layout or default_layout(preset)
    if layout not in LAYOUTS:
        raise ConfigError(f"layout {layout!r} not in {LAYOUTS}")
    gpt_oss = p.config["model_type"] == "gpt_oss"
    if gpt_oss and layout != "stacked":
        raise ConfigError(f"layout {layout!r}: gpt-oss checkpoints stack their experts (mlp.experts.*, as mlx-lm "
                          "and the hub store them); use layout 'stacked'")
    if mode != "affine" and (mode not in FP_MODES or gpt_oss):
        why = ("gpt-oss presets write their experts in mxfp4 and the rest affine, as published" if gpt_oss
               else f"not one of affine, {', '.join(FP_MODES)}")
        raise ConfigError(f"mode {mode!r}: {why}")
    if mode in FP_MODES:
        group_size, bits = FP_MODES[mode]
    elif bits not in AFFINE_BITS or group_size not in AFFINE_GROUP_SIZES:
        raise ConfigError(f"bits {bits} / group size {group_size}: need bits in {AFFINE_BITS} and group size "
                          f"in {AFFINE_GROUP_SIZES}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} not in {sorted(DTYPES)}")
    finite_number(shard_gb, "shard size (GB)", 0)
    check_seed(seed)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty folder (choose a new folder)")
    config = {**cut_to(p.config, layers, f"preset {preset}"), "torch_dtype": dtype}
    args = model_args(config, source=f"preset {preset}")
    check_vocabulary(args.vocab_size, args.eos_token_id)  # before the weights: the tokenizer is written last
    count = len(tensor_shapes(args))
    tensors = Progress(random_tensors(args, seed, DTYPES[dtype], generator), total=count, unit="tensor",
                   desc=f"make-random {preset}", disable=not progress, mininterval=2.0)
    if gpt_oss:
        quantized = gpt_oss_mlx_lm_tensors(tensors, args, group_size, bits)
        config["quantization"] = gpt_oss_quantization(args, group_size, bits)
    else:
        quantized = quantize_tensors(tensors, group_size, bits, layout, args.num_experts, mode=mode,
                                     skip=kept_float(args))
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": mode}
    config["quantization_config"] = config["quantization"]
    save_checkpoint(out, config, quantized, shard_bytes=int(shard_gb * 1e9))
    write_byte_tokenizer(out, args.vocab_size, args.eos_token_id)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-random", help="write a random-weight quantized checkpoint of a named model shape")
    p.add_argument("out_dir", help="new folder to write (config.json, shards, index, a byte-level tokenizer)")
    p.add_argument("--preset", default="qwen1.5-moe-a2.7b", choices=sorted(PRESETS), metavar="PRESET",
                   help="the model shape to write, one of " + ", ".join(sorted(PRESETS)) + " (default %(default)s)")
    p.add_argument("--bits", type=int, default=4, choices=AFFINE_BITS,
                   help="affine quantization bits of every quantized weight (default %(default)s)")
    p.add_argument("--group-size", type=int, default=64, choices=AFFINE_GROUP_SIZES,
                   help="affine quantization group size (default %(default)s)")
    p.add_argument("--mode", default="affine", choices=("affine", *FP_MODES),
                   help="quantization mode of every quantized weight, as mlx_lm.convert --q-mode writes it; the "
                        "microscaled modes fix their own bits and group size (" + ", ".join(
                            f"{m} {b}-bit g{g}" for m, (g, b) in FP_MODES.items()) + "); default %(default)s")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                   help="dtype of scales, biases, norms (float32 for CPU comparisons with mlx-lm)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of the random weights (default %(default)s)")
    p.add_argument("--shard-gb", type=finite(0), default=DEFAULT_SHARD_GB,
                   help="largest safetensors shard, in GB (default %(default)s)")
    p.add_argument("--generator", choices=("mlx", "numpy"), default="mlx",
                   help="mlx: fast on a GPU; numpy: the generator test checkpoints use")
    p.add_argument("--layout", choices=LAYOUTS, default=None,
                   help="routed experts stacked (mlp.switch_mlp.*) or per expert (mlp.experts.{i}.*); default: as "
                        "the family's MLX checkpoints (" + ", ".join(
                            f"{f.name} {f.expert_layout}" for f in dict.fromkeys(families().values())) + ")")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="write only the preset's first N decoder layers, each of its full shape (a model cut to fit "
                        "a machine's disk or memory; default: all)")
    p.set_defaults(run=_run)


def _run(a: argparse.Namespace) -> int:
    start = time.perf_counter()
    layout = a.layout or default_layout(a.preset)
    folder = write_random(a.out_dir, a.preset, a.bits, a.group_size, a.dtype, a.seed, a.shard_gb, a.generator,
                          layout=layout, mode=a.mode, layers=a.layers)
    total, active = parameter_counts(cut_to(PRESETS[a.preset].config, a.layers, f"preset {a.preset}"))
    gpt_oss = PRESETS[a.preset].config["model_type"] == "gpt_oss"
    experts = GPT_OSS_EXPERT_NAMES if gpt_oss else EXPERT_NAMES[layout]
    files = sorted(folder.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {folder}: {len(files)} file(s), {size / 1e9:.2f} GB, {total / 1e9:.2f}B parameters "
          f"({active / 1e9:.2f}B active), {quantized_as(a)} {a.dtype}, experts {layout} "
          f"({experts}), {time.perf_counter() - start:.1f} s")
    return 0


def quantized_as(a: argparse.Namespace) -> str:
    """How make-random's arguments quantize the weights, in words."""
    if a.mode in FP_MODES:
        group_size, bits = FP_MODES[a.mode]
        return f"{a.mode} ({bits}-bit g{group_size})"
    return f"{a.bits}-bit g{a.group_size}"
