"""The compiled decode step on the hybrids (Qwen3-Next, Qwen3.5-MoE): their linear-attention layers' recurrent states
are the traced step's inputs and outputs, so it decodes what the eager loop decodes, rolls back exactly, and holds
keys and values for the full-attention layers alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hybrids import HYBRID_PRESETS

import moebench
from moebench.decode import compiled as compiled_module
from moebench.decode.cache import KVCache, kv_cache_bytes
from moebench.decode.compiled import CompiledForward, compile_blocker
from moebench.decode.loop import STEPS_AHEAD, Session, generate, generate_tokens
from moebench.decode.state import LinearAttentionState
from moebench.errors import DecodeError
from moebench.execution.executor import executor

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
ATOL = 1e-5


def _decode(model, steps: int, compiled: bool) -> tuple[list[int], list[np.ndarray]]:
    pairs = list(generate_tokens(model, PROMPT, steps, compiled=compiled))
    return [t for t, _ in pairs], [np.array(logits) for _, logits in pairs]


def _assert_same(a: tuple[list[int], list[np.ndarray]], b: tuple[list[int], list[np.ndarray]]) -> None:
    assert a[0] == b[0]
    assert max(np.abs(x - y).max() for x, y in zip(a[1], b[1], strict=True)) <= ATOL


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("preset", HYBRID_PRESETS)
def test_compiled_hybrid_decode_equals_eager_for_64_steps(tiny_hybrids, preset, fused):
    """Greedy tokens and every step's logits of the compiled step equal the eager loop's over 64 steps (the
    recurrent state carried through the traced step does not drift), and the dispatch counts are the same."""
    model, _ = moebench.load(tiny_hybrids[preset])
    ex = executor(model)
    with moebench.fused_moe(fused, model):
        ex.reset_counts()
        eager = _decode(model, 64, compiled=False)
        eager_counts = moebench.dispatch(model)
        ex.reset_counts()
        compiled = _decode(model, 64, compiled=True)
        assert ex.compiled  # a traced step ran, not the eager loop
        _assert_same(compiled, eager)
        counts = moebench.dispatch(model)
        launches = [(e["count"], c["count"]) for e, c in zip(eager_counts.pop("launches")["layers"].values(),
                                                            counts.pop("launches")["layers"].values(), strict=True)]
        assert counts == eager_counts
        assert counts["moe"][0]["fused"] == ({"reference": 63} if fused else {})
        # the full-attention layer's kernel writes the compiled step's static cache in place: two launches fewer
        assert launches == ([(None, None)] * 3 + [(10, 8)] if fused else [(None, None)] * 4)


def test_compiled_step_equals_the_eager_cache_step_by_step(tiny_hybrids):
    """CompiledForward's logits after a one-token prompt (its states start as zeros in the traced step) and after
    each fed token equal the model's own forward over its eager caches."""
    model, _ = moebench.load(tiny_hybrids["qwen3.5-moe-tiny"])
    ex = executor(model)
    fast = CompiledForward(ex, 32)
    caches = Session(model, compiled=False).cache
    for tok in PROMPT[:6]:
        t = mx.array([tok], dtype=mx.uint32)
        a, b = fast(t, ex.settings)[0], model(t[None], caches)[0, -1]
        assert mx.allclose(a, b, atol=ATOL).item()
    assert fast.position == 6 and all(s.offset == 6 for s in fast.cache.states)


def test_a_prompt_prefilled_in_chunks_leaves_the_states_of_one_pass(tiny_hybrids, monkeypatch):
    """A prompt longer than a prefill chunk runs chunk after chunk through the static cache, each chunk continuing
    the states the one before left: the decode after it equals the eager one that prefilled the prompt at once."""
    model, _ = moebench.load(tiny_hybrids["qwen3.5-moe-tiny"])
    eager = _decode(model, 8, compiled=False)
    monkeypatch.setattr(compiled_module, "PREFILL_CHUNK", 4)  # 10 prompt tokens: chunks of 4, 4 and 2
    _assert_same(_decode(model, 8, compiled=True), eager)


def _greedy(forward: CompiledForward, feed: list[int], settings) -> tuple[int, np.ndarray]:
    logits = forward(mx.array(feed, dtype=mx.uint32), settings)[0]
    return int(mx.argmax(logits).item()), np.array(logits)


def test_rollback_mid_decode_then_resume_equals_an_uninterrupted_decode(tiny_hybrids):
    """Steps fed and rolled back (as the decode loop rolls back the steps it queued) leave the keys, values and
    recurrent states as they were: resuming gives an uninterrupted decode's tokens and logits exactly. A rewind
    further back than kept is refused and changes nothing."""
    model, _ = moebench.load(tiny_hybrids["qwen3-next-tiny"])
    ex = executor(model)
    settings = ex.settings
    plain = CompiledForward(ex, 64)
    tok, _ = _greedy(plain, PROMPT, settings)
    expected = []
    for _ in range(12):
        tok, logits = _greedy(plain, [tok], settings)
        expected.append((tok, logits))

    forward = CompiledForward(ex, 64, keep=STEPS_AHEAD + 1)
    tok, _ = _greedy(forward, PROMPT, settings)
    got = []
    for n in range(12):
        if n in (3, 8):  # queue two steps from other tokens, then take them back, newest first
            at = forward.position
            _greedy(forward, [1], settings)
            _greedy(forward, [2], settings)
            forward.rewind_to(at + 1)
            forward.rewind_to(at)
        tok, logits = _greedy(forward, [tok], settings)
        got.append((tok, logits))
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, expected, strict=True))

    at = forward.position
    with pytest.raises(DecodeError, match=f"cannot rewind to position {at - STEPS_AHEAD - 1}"):
        forward.rewind_to(at - STEPS_AHEAD - 1)
    assert forward.position == at and all(s.offset == at for s in forward.cache.states)
    forward.rewind_to(0)  # the empty state is always within reach: the same decode again
    tok, _ = _greedy(forward, PROMPT, settings)
    assert _greedy(forward, [tok], settings)[0] == expected[0][0]


def test_settings_changed_mid_decode_roll_back_the_queued_compiled_steps(tiny_hybrids):
    """The fused switch flipped between tokens rolls back the steps the loop queued under the old settings and
    builds them again: the compiled decode follows the eager one token for token."""

    def toggled(model, compiled: bool) -> tuple[list[int], list[np.ndarray]]:
        tokens, logits = [], []
        with moebench.fused_moe(True, model):
            for n, (tid, step) in enumerate(generate_tokens(model, PROMPT, 20, compiled=compiled)):
                tokens.append(tid)
                logits.append(np.array(step))
                if n in (4, 11):
                    moebench.set_fused_moe(n == 11, model)
        return tokens, logits

    model, _ = moebench.load(tiny_hybrids["qwen3.5-moe-tiny"])
    _assert_same(toggled(model, True), toggled(model, False))


def test_an_interrupted_prefill_writes_no_state(tiny_hybrids, monkeypatch):
    """A forward that fails part-way through its layers (after the first linear-attention layer wrote its new
    states) changes nothing: called again, the compiled forward gives an uninterrupted one's logits."""
    model, _ = moebench.load(tiny_hybrids["qwen3-next-tiny"])
    ex = executor(model)
    expected = np.array(CompiledForward(ex, 32)(mx.array(PROMPT, dtype=mx.uint32), ex.settings)[0])
    forward = CompiledForward(ex, 32)
    mixer = type(model.layers[1].linear_attn)
    real, calls = mixer.__call__, []

    def interrupted(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mixer, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        forward(mx.array(PROMPT, dtype=mx.uint32), ex.settings)
    assert forward.position == 0 and all(s.conv is None for s in forward.cache.states)
    again = np.array(forward(mx.array(PROMPT, dtype=mx.uint32), ex.settings)[0])
    assert np.array_equal(again, expected)


def test_only_full_attention_layers_hold_keys_and_values(tiny_hybrids):
    """The static cache allocates one block a full-attention layer (one of the tiny hybrid's four) and a recurrent
    state a linear-attention layer; its bytes are kv_cache_bytes'. The eager caches are the same split."""
    model, _ = moebench.load(tiny_hybrids["qwen3-next-tiny"])
    forward = CompiledForward(executor(model), 100, keep=3)
    cache, attn = forward.cache, model.layers[3].self_attn
    assert cache.blocks == (None, None, None, 0)
    assert cache.keys.shape == (1, attn.n_kv_heads, 256, attn.head_dim)
    assert cache.keys.nbytes + cache.values.nbytes == kv_cache_bytes(model, 256)
    assert [s.keep for s in cache.states] == [3] * 3
    session = Session(model, compiled=False)
    assert [type(c) for c in session.cache] == [LinearAttentionState] * 3 + [KVCache]


def test_generate_compiles_a_hybrid(tiny_hybrids):
    """Nothing refuses a hybrid the compiled step: a Session asked for it gets one (recording still runs eagerly),
    and generate(..., compiled=True) decodes what the eager loop decodes."""
    model, _ = moebench.load(tiny_hybrids["qwen3-next-tiny"])
    assert compile_blocker(False) is None and "recording" in compile_blocker(True)
    assert Session(model, compiled=True).compiled is not None
    assert Session(model, compiled=True, recording=True).compiled is None
    eager = generate(model, PROMPT, 16, compiled=False)
    compiled = generate(model, PROMPT, 16, compiled=True)
    assert compiled.token_ids == eager.token_ids and len(compiled.token_ids) == 16
