"""Mixtral (Mixtral-8x7B / -8x22B): what differs from Qwen2-MoE, and nothing else.

- MoE block: the top-k logits, then a softmax over those k (transformers' softmax over all experts, top-k,
  renormalised: the same numbers); no shared expert, no biases; every layer a MoE layer;
- attention: no q/k/v bias;
- config.json: `num_local_experts` experts of width `intermediate_size`;
- stored: the block is `block_sparse_moe` (so it is named here too, as mlx-lm names it); the hub's folders keep
  the experts one by one as w1 (gate), w3 (up) and w2 (down), mlx-lm's conversions stack them in `switch_mlp`.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from typing import Any

from ..errors import ConfigError
from . import qwen2_moe
from .args import ModelArgs
from .declare import TOPK_THEN_SOFTMAX, MoeSpec
from .family import Family, Preset, StoredTensors

HUB_EXPERTS = re.compile(r"^(?P<at>.+\.block_sparse_moe\.experts\.\d+)\.w(?P<w>[123])(?P<rest>(\.\w+)?)$")
PROJECTION = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's config.json in the fields every family reads: every layer MoE, no shared expert."""
    if cfg.get("sliding_window") is not None:
        raise ConfigError(f"config.json: field 'sliding_window' is {cfg['sliding_window']!r}; Mixtral with a sliding "
                          "window is not supported (the published Mixtral models set none)")
    return {"moe_intermediate_size": cfg.get("intermediate_size"), "qkv_bias": False, "norm_topk_prob": True,
            "shared_expert_intermediate_size": 0, "mlp_only_layers": [], "decoder_sparse_step": 1}


def hub_names(store: StoredTensors, args: ModelArgs) -> ModelArgs:
    """The hub's per-expert w1 / w3 / w2 under the projection names the experts have here (and in mlx-lm's
    conversions); the quantization entries alike."""
    for name in list(store.names()):
        if (m := HUB_EXPERTS.match(name)) is not None:
            store.rename(name, f"{m['at']}.{PROJECTION[m['w']]}{m['rest']}")
    if args.quantization is not None:
        overrides = {(f"{m['at']}.{PROJECTION[m['w']]}" if (m := HUB_EXPERTS.match(path)) else path): spec
                     for path, spec in args.quantization.overrides.items()}
        args = replace(args, quantization=replace(args.quantization, overrides=overrides))
    return args


class SparseMoeBlock(qwen2_moe.SparseMoeBlock):
    """Qwen2-MoE's block scored as Mixtral scores: the softmax over the top-k logits."""

    @property
    def spec(self) -> MoeSpec:
        return MoeSpec(self.num_experts, self.top_k, TOPK_THEN_SOFTMAX)


class DecoderLayer(qwen2_moe.DecoderLayer):
    """Qwen2-MoE's layer with its MoE block stored as `block_sparse_moe` (`mlp` names the same block)."""

    @property
    def mlp(self) -> SparseMoeBlock:
        return self["block_sparse_moe"]

    def __setattr__(self, key: str, value: object) -> None:
        super().__setattr__("block_sparse_moe" if key == "mlp" else key, value)


# mistralai/Mixtral-8x7B-v0.1's config.json
MIXTRAL_8X7B = {
    "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 32768, "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
    "router_aux_loss_coef": 0.02, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
Model = partial(qwen2_moe.Model, block=SparseMoeBlock, layer=DecoderLayer)
FAMILY = Family(("mixtral",), Model, config_fields, stored_layout=hub_names, presets=(
    Preset("mixtral-8x7b", "Mixtral-8x7B: 32 layers, D 4096, 32 query heads over 8 kv heads, 8 experts top-2 of "
           "width 14336, vocab 32000 (46.7B parameters, 12.9B active; ~26 GB at 4-bit)", MIXTRAL_8X7B),
    Preset("mixtral-tiny", "the mixtral family at the tiny preset's size: 2 layers, D 128, GQA 4/2, 8 experts top-2 "
           "of width 128, vocab 256", {**MIXTRAL_8X7B, "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 2,
                                       "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                                       "bos_token_id": None, "eos_token_id": None}),
))
