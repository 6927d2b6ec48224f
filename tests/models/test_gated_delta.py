"""Gated DeltaNet (moebench.models.gated_delta) against transformers' torch layers (Qwen3-Next's fused projections
and Qwen3.5's split ones, float32) and mlx-lm's, on a whole prompt and token by token for 64 steps after it (the
recurrent state must not drift); the chunked delta rule a prompt runs through against the token-by-token one; and
its state cache (moebench.decode.state): a rewind after queued steps puts the layer back exactly, one too far is a
DecodeError.

The weights are random with decays near 1 (A = exp(A_log) in [0.01, 0.2]), so the state remembers the whole
sequence and a drift would show.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moebench.decode.loop import STEPS_AHEAD
from moebench.decode.state import LinearAttentionState
from moebench.errors import ConfigError, DecodeError
from moebench.models.args import ModelArgs
from moebench.models.gated_delta import (
    FUSED_QKVZ,
    SPLIT_QKV_Z_B_A,
    GatedDeltaNet,
    LinearAttentionArgs,
    chunked_delta_rule,
    delta_rule,
    delta_step,
    normalize_qk,
    stepped_delta_rule,
)

torch = pytest.importorskip("torch", reason="the reference layers are transformers' (dev dependency torch)")

TOLERANCE = 1e-4
PROMPT, STEPS = 12, 64
HIDDEN = 48
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
LAYOUTS = {"qwen3_next": FUSED_QKVZ, "qwen3_5_moe": SPLIT_QKV_Z_B_A}


def tiny_args(**fields) -> ModelArgs:
    """ModelArgs of a tiny hybrid (what the layers read: sizes, eps, rope theta, layer types)."""
    base = dict(model_type="qwen3_next", hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=64, num_experts=0, num_experts_per_tok=1,
                moe_intermediate_size=16, shared_expert_intermediate_size=0, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=(), rope_theta=10_000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, vocab_size=64, qkv_bias=False, layer_types=("linear_attention",))
    return ModelArgs(**{**base, **fields})


def linear_args(family: str) -> LinearAttentionArgs:
    return LinearAttentionArgs(LINEAR["linear_num_key_heads"], LINEAR["linear_num_value_heads"],
                               LINEAR["linear_key_head_dim"], LINEAR["linear_value_head_dim"],
                               LINEAR["linear_conv_kernel_dim"], LAYOUTS[family])


OFFSET_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def offset_norm(name: str) -> bool:
    """Whether transformers stores this norm's weight as an offset from 1 (moebench holds 1 + w)."""
    return name.endswith(OFFSET_NORMS) or name == "model.norm.weight"


def randomize(module, seed: int) -> None:
    """Weights of useful size: matrices ~ 1/sqrt(fan_in), norms near 1 (offset norms near 0), decays near 1,
    dt_bias around 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.01 + 0.19 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * noise)
            elif name.endswith("norm.weight"):
                p.copy_((0.0 if offset_norm(name) else 1.0) + 0.1 * noise)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def to_mlx(name: str, value) -> mx.array:
    """A transformers tensor as moebench and mlx-lm hold it: the depthwise conv's [C, 1, K] as [C, K, 1], an offset
    norm's w as 1 + w."""
    array = mx.array(value.detach().numpy())
    if name.endswith("conv1d.weight"):
        return array.moveaxis(2, 1)
    return array + 1.0 if offset_norm(name) else array


def linear_weights(torch_layer) -> list[tuple[str, mx.array]]:
    return [(name, to_mlx(name, p)) for name, p in torch_layer.named_parameters()]


def torch_config(family: str, **fields):
    """transformers' config of the tiny hybrid (every fourth layer full)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    base = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=24, rms_norm_eps=1e-6, **LINEAR)
    if family == "qwen3_next":
        return Qwen3NextConfig(**base, intermediate_size=64, **fields)
    return Qwen3_5MoeTextConfig(**base, **fields)


def torch_layer(family: str, seed: int = 0):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cls = Qwen3NextGatedDeltaNet if family == "qwen3_next" else Qwen3_5MoeGatedDeltaNet
    layer = cls(torch_config(family), 0).eval()
    randomize(layer, seed)
    return layer


def our_layer(family: str, reference) -> GatedDeltaNet:
    layer = GatedDeltaNet(tiny_args(), linear_args(family))
    layer.load_weights(linear_weights(reference), strict=True)
    return layer


def inputs(seed: int, length: int = PROMPT + STEPS) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, length, HIDDEN)).astype(np.float32)


def run_ours(layer: GatedDeltaNet, x: np.ndarray, prompt: int = PROMPT) -> tuple[np.ndarray, LinearAttentionState]:
    """The prompt in one call, then one token a call; the outputs of every position."""
    cache = LinearAttentionState(keep=STEPS_AHEAD + 1)
    outs = [layer(mx.array(x[:, :prompt]), cache)]
    outs += [layer(mx.array(x[:, t : t + 1]), cache) for t in range(prompt, x.shape[1])]
    return np.array(mx.concatenate(outs, axis=1)), cache


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_matches_transformers_whole_and_stepped(family):
    from transformers.cache_utils import DynamicCache

    reference = torch_layer(family)
    ours = our_layer(family, reference)
    x = inputs(1)
    cache = DynamicCache(config=torch_config(family))
    with torch.no_grad():
        whole = reference(torch.from_numpy(x)).numpy()
        stepped = [reference(torch.from_numpy(x[:, :PROMPT]), cache=cache)]
        stepped += [reference(torch.from_numpy(x[:, t : t + 1]), cache=cache) for t in range(PROMPT, x.shape[1])]
    stepped = torch.cat(stepped, dim=1).numpy()
    assert np.abs(np.array(ours(mx.array(x))) - whole).max() <= TOLERANCE
    got, state = run_ours(ours, x)
    assert state.offset == PROMPT + STEPS
    assert np.abs(got - stepped).max() <= TOLERANCE
    assert np.abs(got[:, -1] - stepped[:, -1]).max() <= TOLERANCE  # the 64th step too
    # the state itself: transformers holds S as [key_dim, value_dim], moebench (as mlx-lm) [value_dim, key_dim]
    theirs = cache.get_recurrent_state(0, state_idx=0).numpy().swapaxes(-1, -2)
    assert np.abs(np.array(state.delta) - theirs).max() <= TOLERANCE
    # the conv state: transformers keeps the last `kernel` positions [B, C, K], moebench the last kernel - 1
    conv = cache.get_conv_state(0, state_idx=0).numpy()[..., 1:]
    assert np.abs(np.array(state.conv).swapaxes(1, 2) - conv).max() <= TOLERANCE


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_matches_mlx_lm_whole_and_stepped(family):
    from mlx_lm.models import qwen3_5, qwen3_next
    from mlx_lm.models.cache import ArraysCache

    reference = torch_layer(family, seed=3)
    ours = our_layer(family, reference)
    config = torch_config(family).to_dict()
    if family == "qwen3_next":
        theirs = qwen3_next.Qwen3NextGatedDeltaNet(qwen3_next.ModelArgs.from_dict(
            {**config, "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}))
    else:
        theirs = qwen3_5.GatedDeltaNet(qwen3_5.TextModelArgs.from_dict(config))
    theirs.load_weights(linear_weights(reference), strict=True)
    x = inputs(4)
    cache = ArraysCache(size=2)
    expected = [theirs(mx.array(x[:, :PROMPT]), cache=cache)]
    expected += [theirs(mx.array(x[:, t : t + 1]), cache=cache) for t in range(PROMPT, x.shape[1])]
    got, state = run_ours(ours, x)
    assert np.abs(got - np.array(mx.concatenate(expected, axis=1))).max() <= TOLERANCE
    assert np.abs(np.array(state.delta) - np.array(cache[1])).max() <= TOLERANCE
    assert np.abs(np.array(ours(mx.array(x))) - np.array(theirs(mx.array(x)))).max() <= TOLERANCE


def delta_inputs(length: int, seed: int = 0) -> tuple[mx.array, ...]:
    """q, k (normalised as the layer does), v, g, beta and a nonzero state for 2 sequences, 2 key heads serving 4
    value heads. The decays mix every regime: g = 1 (no decay), g in (0, 1), g near 0 and g = 0 (exp underflowed)."""
    rng = np.random.default_rng(seed)
    batch, key_heads, value_heads, dk, dv = 2, 2, 4, 16, 8
    q, k = normalize_qk(*(mx.array(rng.standard_normal((batch, length, key_heads, dk)), mx.float32)
                          for _ in range(2)))
    v = rng.standard_normal((batch, length, value_heads, dv)).astype(np.float32)
    regime = rng.integers(0, 4, (batch, length, value_heads))
    g = np.choose(regime, [np.ones(regime.shape), rng.uniform(0.0, 1.0, regime.shape),
                           rng.uniform(1e-9, 1e-4, regime.shape), np.zeros(regime.shape)]).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (batch, length, value_heads)).astype(np.float32)
    state = rng.standard_normal((batch, value_heads, dv, dk)).astype(np.float32)
    return q, k, mx.array(v), mx.array(g), mx.array(beta), mx.array(state)


def relative_error(got: mx.array, expected: mx.array) -> float:
    expected = np.array(expected)
    return float(np.abs(np.array(got) - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 200, 1000])
def test_chunked_delta_rule_equals_stepping(length):
    """Within a chunk, at its edges and over many chunks: the outputs and the final state as stepped."""
    args = delta_inputs(length, seed=length)
    stepped_out, stepped_state = stepped_delta_rule(*args)
    chunked_out, chunked_state = chunked_delta_rule(*args)
    assert chunked_out.shape == stepped_out.shape == (2, length, 4, 8)
    assert relative_error(chunked_out, stepped_out) <= 1e-5
    assert relative_error(chunked_state, stepped_state) <= 1e-5


def test_a_zero_decay_forgets_everything_before_it():
    """g = 0 at a position: the chunked output from there on is the one of a sequence starting there from a zero
    state (the initial state and the positions before do not leak through a masked exp)."""
    q, k, v, g, beta, state = delta_inputs(100, seed=3)
    g = mx.concatenate([g[:, :70], mx.zeros_like(g[:, 70:71]), g[:, 71:]], axis=1)
    out, final = chunked_delta_rule(q, k, v, g, beta, state)
    rest = (t[:, 70:] for t in (q, k, v, g, beta))
    fresh_out, fresh_final = chunked_delta_rule(*rest, mx.zeros_like(state))
    assert relative_error(out[:, 70:], fresh_out) <= 1e-5
    assert relative_error(final, fresh_final) <= 1e-5


def test_one_position_is_exactly_the_decode_step():
    """A decode step (one position) goes through delta_step unchanged: bit for bit the per-token update."""
    q, k, v, g, beta, state = delta_inputs(1, seed=4)
    out, final = delta_rule(q, k, v, g, beta, state)
    expected_out, expected_state = delta_step(mx.repeat(q[:, 0], 2, axis=1), mx.repeat(k[:, 0], 2, axis=1), v[:, 0],
                                              g[:, 0], beta[:, 0], state)
    assert np.array_equal(np.array(out[:, 0]), np.array(expected_out))
    assert np.array_equal(np.array(final), np.array(expected_state))


def test_prompt_in_chunks_equals_it_whole():
    """A long prompt fed a chunk at a time (as the executor feeds one) continues the states across chunks."""
    ours = our_layer("qwen3_next", torch_layer("qwen3_next", seed=5))
    x = inputs(6, 20)
    whole = np.array(ours(mx.array(x)))
    cache = LinearAttentionState(keep=2)
    parts = [ours(mx.array(x[:, a:b]), cache) for a, b in ((0, 7), (7, 8), (8, 20))]
    assert np.abs(np.array(mx.concatenate(parts, axis=1)) - whole).max() <= 1e-5


def test_the_kept_conv_state_does_not_hold_the_prompt():
    """The conv state a long prompt leaves is its own few positions, not a view into the prompt's projections: a
    kept state held the whole chunk's [q | k | v] per layer (2 GB of prefill memory at Qwen3.5-35B-A3B's size,
    docs/benchmarks/issue41-qwen3.5-35b-a3b-h200-2026-12-03.md)."""
    ours = our_layer("qwen3_5_moe", torch_layer("qwen3_5_moe", seed=5))
    cache = LinearAttentionState(keep=2)
    mx.eval(ours(mx.array(inputs(6, 4096)), cache), cache.state)
    mx.clear_cache()
    held = mx.get_active_memory()
    window_bytes = 4096 * ours.linear.conv_dim * 4  # the prompt's projections, float32
    cache.rewind_to(0)  # drops the state written by the prompt
    mx.clear_cache()
    assert held - mx.get_active_memory() < window_bytes / 8


def test_rewind_then_step_equals_an_uninterrupted_run_exactly():
    """Steps queued ahead and rolled back (one, then two) leave outputs and states bit for bit as never taken."""
    ours = our_layer("qwen3_5_moe", torch_layer("qwen3_5_moe", seed=7))
    x = inputs(8, PROMPT + 8)
    other = inputs(9, PROMPT + 8)  # the tokens of the steps that are rolled back
    straight, straight_state = run_ours(ours, x)

    cache = LinearAttentionState(keep=STEPS_AHEAD + 1)
    outs = [ours(mx.array(x[:, :PROMPT]), cache)]
    for t in range(PROMPT, x.shape[1]):
        back = 1 if t == PROMPT + 2 else 2 if t == PROMPT + 5 else 0
        for j in range(back):  # steps built ahead from other tokens, then dropped
            ours(mx.array(other[:, t + j : t + j + 1]), cache)
        cache.rewind_to(t)
        assert cache.offset == t
        outs.append(ours(mx.array(x[:, t : t + 1]), cache))
    assert np.array_equal(np.array(mx.concatenate(outs, axis=1)), straight)
    assert np.array_equal(np.array(cache.delta), np.array(straight_state.delta))
    assert np.array_equal(np.array(cache.conv), np.array(straight_state.conv))


def test_rewind_too_far_is_a_named_error_and_changes_nothing():
    ours = our_layer("qwen3_next", torch_layer("qwen3_next", seed=10))
    x = inputs(11, PROMPT + 4)
    cache = LinearAttentionState(keep=2)
    ours(mx.array(x[:, :PROMPT]), cache)
    for t in range(PROMPT, PROMPT + 4):
        ours(mx.array(x[:, t : t + 1]), cache)
    delta = cache.delta
    with pytest.raises(DecodeError, match=r"cannot rewind to position 13.*positions \[0, 15, 16\]"):
        cache.rewind_to(PROMPT + 1)  # three writes back, two kept
    with pytest.raises(DecodeError, match="cannot rewind to position 5"):
        cache.rewind_to(5)  # inside the prompt's one write
    with pytest.raises(DecodeError, match="cannot rewind to position 17"):
        cache.rewind_to(PROMPT + 5)  # ahead of the state
    assert cache.offset == PROMPT + 4 and cache.delta is delta
    cache.rewind_to(0)  # the empty state: a fresh sequence
    assert cache.offset == 0 and cache.state == ()
    assert np.array_equal(np.array(ours(mx.array(x[:, :3]), cache)), np.array(ours(mx.array(x[:, :3]))))


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_keep_must_be_a_positive_integer(keep):
    with pytest.raises(DecodeError, match="keep must be an integer >= 1"):
        LinearAttentionState(keep)


def test_bad_sizes_are_config_errors():
    with pytest.raises(ConfigError, match=r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads"):
        LinearAttentionArgs(2, 3, 16, 8, 4, FUSED_QKVZ)
    with pytest.raises(ConfigError, match="layout 'x' is not one of"):
        LinearAttentionArgs(2, 4, 16, 8, 4, "x")
