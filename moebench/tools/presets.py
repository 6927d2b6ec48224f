"""Named model shapes, and `moebench make-random`: random-weight checkpoints at those shapes.

Real-size presets copy published configs, so a random checkpoint has the real model's tensor names, shapes
and shard structure, with its experts laid out as the family's MLX checkpoints lay them out (FAMILY_LAYOUTS),
and benchmarks run at real size with nothing to download.
Small presets keep every code path (GQA, shared expert, widths the fused kernel supports) at CPU sizes.
Weights stream through moebench.tools.writer one tensor at a time: generated, quantized, written to the
current shard; the float model is never whole in memory.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ..checkpoint.config import model_args
from ..checkpoint.weights import LAYOUTS, tensor_shapes
from ..decode.sampling import check_seed
from ..errors import ConfigError
from ..models.args import AFFINE_BITS, AFFINE_GROUP_SIZES, FP_MODES
from .byte_tokenizer import write_byte_tokenizer
from .flags import SEED, finite, finite_number
from .progress import Progress
from .writer import (
    gpt_oss_mlx_lm_tensors,
    gpt_oss_quantization,
    quantize_tensors,
    qwen2_moe_config,
    random_tensors,
    save_checkpoint,
)

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
DEFAULT_SHARD_GB = 5.0  # mlx-lm's shard size
# how the family's MLX checkpoints store the routed experts, so mlx-lm loads what make-random writes as it loads
# the checkpoints people run: mlx-community's Qwen1.5-MoE conversions keep experts.{i}; mlx-lm's convert stacks
# Qwen3-MoE's into switch_mlp (and mlx-lm's qwen3_moe stacks per-expert weights only when they are unquantized);
# mlx-lm's olmoe stacks OLMoE's into switch_mlp when it converts (its sanitize)
FAMILY_LAYOUTS = {"qwen2_moe": "per-expert", "qwen3_moe": "stacked", "olmoe": "stacked", "gpt_oss": "stacked",
                  "qwen3_next": "stacked", "qwen3_5_moe": "stacked"}
EXPERT_NAMES = {"stacked": "mlp.switch_mlp.*", "per-expert": "mlp.experts.{i}.*"}
GPT_OSS_EXPERT_NAMES = "mlp.experts.{gate,up,down}_proj.* in mxfp4, router mlp.router.* in 8 bits"


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    config: dict


QWEN15_MOE_A27B = qwen2_moe_config(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
    intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
    num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, max_position_embeddings=8192,
    bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16", use_sliding_window=False,
    sliding_window=32768, max_window_layers=21, attention_dropout=0.0, router_aux_loss_coef=0.001,
)

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "qkv_bias": False, "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}

# the largest of either family: more than one device holds them (moebench.models.sharding)
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                   "intermediate_size": 12288, "moe_intermediate_size": 1536}
QWEN2_57B_A14B = {**QWEN15_MOE_A27B, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                  "num_key_value_heads": 4, "intermediate_size": 18944, "moe_intermediate_size": 2560,
                  "shared_expert_intermediate_size": 20480, "num_experts": 64, "num_experts_per_tok": 8,
                  "max_position_embeddings": 32768, "max_window_layers": 28}

# allenai/OLMoE-1B-7B-0924's config.json (the -0125 release computes the same): `intermediate_size` is the expert
# width (OLMoE has no moe_intermediate_size and no shared expert); the top-8 probabilities are not renormalised;
# q_norm / k_norm are RMSNorms over the whole q and k projections
OLMOE_1B_7B = {
    "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": 50304, "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 1024,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "rope_theta": 10000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None, "hidden_act": "silu",
    "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1,
    "output_router_logits": False, "router_aux_loss_coef": 0.01, "torch_dtype": "bfloat16", "use_cache": True,
}

# openai/gpt-oss-20b's config.json: experts of width `intermediate_size` (2880, D too) with biases and the clamped
# SwiGLU, router with a bias (top-4 logits then softmax), 64 query / 8 kv heads of 64 with biases and sinks, a
# 128-position window on every other layer (sliding first), YaRN rotary (factor 32 over 4096, not truncated).
# make-random writes it as mlx-lm's convert and the published MLX conversions do (writer.gpt_oss_mlx_lm_tensors):
# mlp.router in 8 bits, experts stacked at mlp.experts.* in mxfp4, the rest at the affine bits asked for
GPT_OSS_20B = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "attention_bias": True, "attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": 0.02,
    "router_aux_loss_coef": 0.9, "output_router_logits": False, "use_cache": True, "eos_token_id": 200002,
    "pad_token_id": 199999, "torch_dtype": "bfloat16",
}

PRESETS = {p.name: p for p in (
    Preset("qwen1.5-moe-a2.7b", "Qwen1.5-MoE-A2.7B: 24 layers, D 2048, 60 experts top-4 of width 1408, shared "
           "expert 5632, vocab 151936 (14.3B parameters, 2.7B active; ~8 GB at 4-bit)", QWEN15_MOE_A27B),
    Preset("qwen1.5-moe-a2.7b-2l", "Qwen1.5-MoE-A2.7B's widths and vocabulary with 2 layers: real per-layer "
           "shapes on a CPU", {**QWEN15_MOE_A27B, "num_hidden_layers": 2}),
    Preset("qwen3-30b-a3b", "Qwen3-30B-A3B: 48 layers, D 2048, 128 experts top-8 of width 768, no shared expert "
           "(qwen3_moe family; ~17 GB at 4-bit)", QWEN3_30B_A3B),
    Preset("qwen3-30b-a3b-2l", "Qwen3-30B-A3B's widths and vocabulary with 2 layers: real per-layer shapes on a "
           "CPU", {**QWEN3_30B_A3B, "num_hidden_layers": 2}),
    Preset("qwen3-235b-a22b", "Qwen3-235B-A22B: 94 layers, D 4096, 64 query heads over 4 kv heads, 128 experts "
           "top-8 of width 1536 (~130 GB at 4-bit: for sharding over devices)", QWEN3_235B_A22B),
    Preset("qwen2-57b-a14b", "Qwen2-57B-A14B: 28 layers, D 3584, 28 query heads over 4 kv heads, 64 experts top-8 "
           "of width 2560, shared expert 20480 (~32 GB at 4-bit)", QWEN2_57B_A14B),
    Preset("qwen3-tiny", "the qwen3_moe family at the tiny preset's size: 2 layers, D 128, GQA 4/2 with q/k norm, "
           "8 experts top-2 of width 128 renormalised, vocab 256", {
               **QWEN3_30B_A3B, "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
               "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2,
               "max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": None}),
    Preset("olmoe-1b-7b", "OLMoE-1B-7B: 16 layers, D 2048, 16 heads (MHA, head_dim 128), 64 experts top-8 of width "
           "1024 not renormalised, no shared expert, vocab 50304 (6.9B parameters, 1.3B active; ~3.9 GB at 4-bit)",
           OLMOE_1B_7B),
    Preset("olmoe-tiny", "the olmoe family at the tiny preset's size: 2 layers, D 128, GQA 4/2 with q/k norm over "
           "the whole projections, 8 experts top-2 of width 128 not renormalised, vocab 256", {
               **OLMOE_1B_7B, "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "num_experts": 8,
               "num_experts_per_tok": 2, "eos_token_id": None, "pad_token_id": None}),
    Preset("gpt-oss-20b", "gpt-oss-20b: 24 layers, D 2880, 64 query heads over 8 kv heads of 64 with sinks, a "
           "128-position window on alternate layers, 32 experts top-4 of width 2880 with biases and the clamped "
           "SwiGLU, vocab 201088 (20.9B parameters, 4.2B active with the embeddings)", GPT_OSS_20B),
    Preset("gpt-oss-tiny", "the gpt_oss family at the tiny preset's size: 2 layers (windowed, then full), D 128, "
           "GQA 4/2 of 32 with sinks, window 4, 8 experts top-2 of width 128, vocab 256", {
               **GPT_OSS_20B, "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128,
               "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 4,
               "layer_types": ["sliding_attention", "full_attention"], "eos_token_id": None, "pad_token_id": None}),
    Preset("small", "a small Qwen2-MoE for quick runs: 4 layers, D 256, GQA 4/2, 16 experts top-4 of width 256, "
           "shared expert 512, vocab 8192", qwen2_moe_config(
               vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=512, moe_intermediate_size=256, shared_expert_intermediate_size=512,
               num_experts=16, num_experts_per_tok=4)),
    Preset("tiny", "writer.qwen2_moe_config's test shape: 2 layers, D 128, 8 experts top-2, vocab 256",
           qwen2_moe_config()),
)}


# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (transformers' Qwen3NextConfig defaults but for experts 512 top-10,
# rope_theta 1e7, 262144 positions): 48 hybrid layers, every 4th full attention (16 query / 2 kv heads of 256, an
# output gate, rotary on a quarter of each head), the others Gated DeltaNet (16 key / 32 value heads of 128, conv 4);
# every layer a MoE block of 512 experts top-10 of width 512 plus a shared expert of 512
QWEN3_NEXT_80B_A3B = {
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 48, "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643,
    "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
# Qwen/Qwen3.5-35B-A3B's text model (its text_config, transformers' Qwen3_5MoeTextConfig defaults but rope_theta 1e7
# and 262144 positions), flat as mlx-lm reads it: 40 hybrid layers as Qwen3-Next's, 256 experts top-8 of width 512
# plus a shared expert of 512, vocab 248320; its Gated DeltaNet projections stored apart (in_proj_qkv, _z, _b, _a);
# the rotary settings inside rope_parameters (the only place mlx-lm's qwen3_5 reads them; its mrope sections give a
# text token one position in every section)
QWEN3_5_35B_A3B = {
    **{k: v for k, v in QWEN3_NEXT_80B_A3B.items() if k not in (
        "intermediate_size", "bos_token_id", "eos_token_id", "rope_theta", "partial_rotary_factor")},
    "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "vocab_size": 248320,
    "num_hidden_layers": 40, "num_experts": 256, "num_experts_per_tok": 8,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
HYBRID_TINY = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                   num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096, bos_token_id=None,
                   eos_token_id=None)
PRESETS.update({p.name: p for p in (
    Preset("qwen3-next-80b-a3b", "Qwen3-Next-80B-A3B: 48 layers (3 of 4 Gated DeltaNet, every 4th gated full "
           "attention), D 2048, 512 experts top-10 of width 512, shared expert 512, vocab 151936", QWEN3_NEXT_80B_A3B),
    Preset("qwen3.5-35b-a3b", "Qwen3.5-35B-A3B's text model: 40 layers (3 of 4 Gated DeltaNet, every 4th gated full "
           "attention), D 2048, 256 experts top-8 of width 512, shared expert 512, vocab 248320", QWEN3_5_35B_A3B),
    Preset("qwen3-next-tiny", "the qwen3_next family at the tiny preset's size: 4 layers (3 Gated DeltaNet, then "
           "gated full attention), D 128, GQA 4/2 of 32, 8 experts top-2 of width 128, shared expert 128, vocab 256",
           {**QWEN3_NEXT_80B_A3B, **HYBRID_TINY}),
    Preset("qwen3.5-moe-tiny", "the qwen3_5_moe family at the tiny preset's size: as qwen3-next-tiny, its linear "
           "projections stored apart", {**QWEN3_5_35B_A3B, **HYBRID_TINY}),
)})

def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def default_layout(preset: str) -> str:
    """The expert layout of the preset's family's MLX checkpoints (FAMILY_LAYOUTS)."""
    return FAMILY_LAYOUTS[get_preset(preset).config["model_type"]]


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


def write_random(
    out_dir: str | Path, preset: str, bits: int = 4, group_size: int = 64, dtype: str = "bfloat16", seed: int = 0,
    shard_gb: float = DEFAULT_SHARD_GB, generator: str = "mlx", progress: bool = True, layout: str | None = None,
    mode: str = "affine",
) -> Path:
    """A random checkpoint of `preset`: MLX affine `bits`/`group_size` (or every quantized weight in a microscaled
    `mode`, whose bits and group size are the mode's, as `mlx_lm.convert --q-mode` writes it), experts in `layout`
    ('stacked' or 'per-expert'; default the family's, default_layout), scales in `dtype`, shards of at most
    `shard_gb` GB with an index, and a byte-level tokenizer of the preset's vocabulary (byte_tokenizer), so text
    prompts encode and every token decodes. Both layouts of one seed hold the same model. gpt-oss is written as
    mlx-lm lays it out (its router and mxfp4 experts under their own quantization, stacked only)."""
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
    config = {**p.config, "torch_dtype": dtype}
    args = model_args(config, source=f"preset {preset}")
    count = len(tensor_shapes(args))
    tensors = Progress(random_tensors(args, seed, DTYPES[dtype], generator), total=count, unit="tensor",
                   desc=f"make-random {preset}", disable=not progress, mininterval=2.0)
    if gpt_oss:
        quantized = gpt_oss_mlx_lm_tensors(tensors, args, group_size, bits)
        config["quantization"] = gpt_oss_quantization(args, group_size, bits)
    else:
        quantized = quantize_tensors(tensors, group_size, bits, layout, args.num_experts, mode=mode)
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
                        "the family's MLX checkpoints (" + ", ".join(f"{f} {v}" for f, v in FAMILY_LAYOUTS.items())
                        + ")")
    p.set_defaults(run=_run)


def _run(a: argparse.Namespace) -> int:
    start = time.perf_counter()
    layout = a.layout or default_layout(a.preset)
    folder = write_random(a.out_dir, a.preset, a.bits, a.group_size, a.dtype, a.seed, a.shard_gb, a.generator,
                          layout=layout, mode=a.mode)
    total, active = parameter_counts(PRESETS[a.preset].config)
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
