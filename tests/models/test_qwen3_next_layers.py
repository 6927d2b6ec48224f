"""The hybrids' full-attention layer (output gate, per-head q/k norm, partial rotary) and the whole tiny Qwen3-Next /
Qwen3.5-MoE model (three linear-attention layers, then a full one, each with the shared-expert MoE block) against
transformers' torch classes in float32, whole prompt and stepped over the caches; and the hybrids' config fields.

The models are built by transformers from a config (`Qwen3NextForCausalLM(config)`), their weights randomised and
assigned into moebench's model directly (no loader): experts' gate_up_proj split into gate and up, the depthwise
conv's [C, 1, K] as [C, K, 1], offset norms as 1 + w.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_gated_delta import HIDDEN, LAYOUTS, TOLERANCE, randomize, tiny_args, to_mlx, torch_config

from moebench.decode.cache import KVCache
from moebench.decode.loop import STEPS_AHEAD
from moebench.decode.state import LinearAttentionState
from moebench.errors import ConfigError
from moebench.models import qwen3_next
from moebench.models.declare import PER_HEAD
from moebench.models.gated_delta import GatedDeltaNet

torch = pytest.importorskip("torch", reason="the reference layers are transformers' (dev dependency torch)")

PROMPT, STEPS = 10, 64


def causal_mask(length: int):
    return torch.full((length, length), float("-inf")).triu(1)[None, None]


def torch_attention(family: str, seed: int, **fields):
    """transformers' full-attention layer (eager) and its rotary embedding."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35
    from transformers.models.qwen3_next import modeling_qwen3_next as qn

    config = torch_config(family, **fields)
    config._attn_implementation = "eager"
    if family == "qwen3_next":
        layer, rotary = qn.Qwen3NextAttention(config, 3), qn.Qwen3NextRotaryEmbedding(config)
    else:
        layer, rotary = q35.Qwen3_5MoeAttention(config, 3), q35.Qwen3_5MoeTextRotaryEmbedding(config)
    randomize(layer.eval(), seed)
    return config, layer, rotary


@pytest.mark.parametrize("family,fields", [("qwen3_next", {}), ("qwen3_5_moe", {}),
                                           ("qwen3_next", {"attention_bias": True, "partial_rotary_factor": 0.5})])
def test_gated_attention_matches_transformers(family, fields):
    config, reference, rotary = torch_attention(family, seed=1, **fields)
    fraction = config.rope_parameters["partial_rotary_factor"]
    ours = qwen3_next.GatedAttention(tiny_args(qkv_bias=config.attention_bias,
                                               rope_theta=config.rope_parameters["rope_theta"]), fraction)
    ours.load_weights([(n, to_mlx(n, p)) for n, p in reference.named_parameters()], strict=True)
    assert ours.spec.rope_fraction == fraction and ours.spec.qk_norm == PER_HEAD
    length = PROMPT + STEPS
    x = np.random.default_rng(2).standard_normal((1, length, HIDDEN)).astype(np.float32)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        cos_sin = rotary(xt, torch.arange(length)[None])
        expected = reference(xt, cos_sin, causal_mask(length))[0].numpy()
    assert np.abs(np.array(ours(mx.array(x))) - expected).max() <= TOLERANCE
    cache = KVCache()
    stepped = [ours(mx.array(x[:, :PROMPT]), cache)] + [ours(mx.array(x[:, t : t + 1]), cache)
                                                        for t in range(PROMPT, length)]
    assert np.abs(np.array(mx.concatenate(stepped, axis=1)) - expected).max() <= TOLERANCE


def torch_model(family: str, seed: int):
    from transformers import Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    config = torch_config(family)
    model = (Qwen3NextForCausalLM if family == "qwen3_next" else Qwen3_5MoeForCausalLM)(config).eval()
    randomize(model, seed)
    return config, model


def moebench_weights(model) -> list[tuple[str, mx.array]]:
    """transformers' state dict under moebench's names and layouts."""
    weights = []
    for name, p in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = mx.split(to_mlx(name, p), 2, axis=1)  # [E, 2I, D]: gate rows, then up rows
            prefix = name.removesuffix("experts.gate_up_proj")
            weights += [(f"{prefix}switch_mlp.gate_proj.weight", gate), (f"{prefix}switch_mlp.up_proj.weight", up)]
        elif name.endswith("experts.down_proj"):
            weights.append((name.replace("experts.down_proj", "switch_mlp.down_proj.weight"), to_mlx(name, p)))
        else:
            weights.append((name, to_mlx(name, p)))
    return weights


def our_model(family: str, config, reference) -> qwen3_next.Model:
    cfg = config.to_dict()
    fields = qwen3_next.config_fields(cfg)
    args = tiny_args(model_type=family, num_hidden_layers=cfg["num_hidden_layers"], num_experts=cfg["num_experts"],
                     num_experts_per_tok=cfg["num_experts_per_tok"], intermediate_size=fields.get(
                         "intermediate_size", cfg.get("intermediate_size")),
                     moe_intermediate_size=cfg["moe_intermediate_size"],
                     shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
                     norm_topk_prob=fields.get("norm_topk_prob", cfg.get("norm_topk_prob")),
                     layer_types=tuple(cfg["layer_types"]), rope_theta=cfg["rope_parameters"]["rope_theta"])
    model = qwen3_next.Model(args, qwen3_next.hybrid_args(cfg))
    model.load_weights(moebench_weights(reference), strict=True)
    return model


def hybrid_cache(model: qwen3_next.Model) -> list:
    """Per layer the cache its layer type takes."""
    return [LinearAttentionState(STEPS_AHEAD + 1) if layer.layer_type == qwen3_next.LINEAR else KVCache()
            for layer in model.layers]


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_tiny_model_logits_match_transformers_whole_and_stepped(family):
    config, reference = torch_model(family, seed=3)
    ours = our_model(family, config, reference)
    kinds = [type(layer.mixer) for layer in ours.layers]
    assert kinds == [GatedDeltaNet] * 3 + [qwen3_next.GatedAttention]
    assert sorted(ours.moe_blocks()) == [0, 1, 2, 3] and all("shared_expert" in b for b in ours.moe_blocks().values())
    ids = np.random.default_rng(4).integers(0, config.vocab_size, (1, PROMPT + STEPS))
    with torch.no_grad():
        expected = reference(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(np.array(ours(mx.array(ids))) - expected).max() <= TOLERANCE
    cache = hybrid_cache(ours)
    stepped = [ours(mx.array(ids[:, :PROMPT]), cache)] + [ours(mx.array(ids[:, t : t + 1]), cache)
                                                          for t in range(PROMPT, ids.shape[1])]
    assert all(c.offset == ids.shape[1] for c in cache)
    assert np.abs(np.array(mx.concatenate(stepped, axis=1)) - expected).max() <= TOLERANCE


def test_rewinding_every_layer_resumes_the_model_exactly():
    """A hybrid's caches rolled back two steps (KV caches and linear-attention states together) give the same
    logits, bit for bit, as never having taken those steps."""
    config, reference = torch_model("qwen3_next", seed=5)
    ours = our_model("qwen3_next", config, reference)
    ids = np.random.default_rng(6).integers(0, config.vocab_size, (1, PROMPT + 3))
    cache = hybrid_cache(ours)
    ours(mx.array(ids[:, :PROMPT]), cache)
    straight = [np.array(ours(mx.array(ids[:, t : t + 1]), cache)) for t in range(PROMPT, ids.shape[1])]
    cache = hybrid_cache(ours)
    ours(mx.array(ids[:, :PROMPT]), cache)
    ours(mx.array([[1]]), cache)
    ours(mx.array([[2]]), cache)
    for c in cache:
        c.rewind_to(PROMPT)
    again = [np.array(ours(mx.array(ids[:, t : t + 1]), cache)) for t in range(PROMPT, ids.shape[1])]
    assert all(np.array_equal(a, b) for a, b in zip(again, straight, strict=True))


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_config_fields_and_hybrid_args_from_transformers_configs(family):
    cfg = torch_config(family, partial_rotary_factor=0.5).to_dict()
    for key in ("layer_types", "norm_topk_prob", "attention_bias"):  # left out, as older files do
        cfg.pop(key, None)
    cfg["full_attention_interval"] = 2
    fields = qwen3_next.config_fields(cfg)
    assert fields["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert fields["qkv_bias"] is False and fields["norm_topk_prob"] is True
    hybrid = qwen3_next.hybrid_args(cfg)
    assert hybrid.rotary_fraction == 0.5 and hybrid.linear.layout == LAYOUTS[family]
    assert (hybrid.linear.num_key_heads, hybrid.linear.num_value_heads, hybrid.linear.conv_kernel) == (2, 4, 4)


def test_bad_hybrid_configs_are_named_errors():
    cfg = torch_config("qwen3_next").to_dict()
    with pytest.raises(ConfigError, match="required field 'linear_conv_kernel_dim' is missing"):
        qwen3_next.hybrid_args({**cfg, "linear_conv_kernel_dim": None})
    with pytest.raises(ConfigError, match="field 'linear_key_head_dim' must be a positive integer"):
        qwen3_next.hybrid_args({**cfg, "linear_key_head_dim": 0})
    with pytest.raises(ConfigError, match="field 'partial_rotary_factor' must be a number in"):
        qwen3_next.hybrid_args({**cfg, "rope_parameters": {"partial_rotary_factor": 1.5}})
    with pytest.raises(ConfigError, match="model_type 'qwen3_moe' is not a hybrid"):
        qwen3_next.hybrid_args({**cfg, "model_type": "qwen3_moe"})
    hybrid = qwen3_next.hybrid_args(cfg)
    with pytest.raises(ConfigError, match="layer_types must give one of"):
        qwen3_next.Model(tiny_args(num_hidden_layers=2, layer_types=("linear_attention", "sliding_attention")),
                         hybrid)
    with pytest.raises(ConfigError, match="no shared_expert_intermediate_size"):
        qwen3_next.Model(tiny_args(num_experts=4, num_experts_per_tok=2), hybrid)
