"""The compiled decode step decodes exactly what the eager loop decodes, and counts every dispatch."""

from __future__ import annotations

import mlx.core as mx
import pytest

import moebench
from moebench.decode.compiled import CompiledForward, compile_blocker
from moebench.decode.loop import generate
from moebench.execution.executor import executor
from moebench.models.routing import Intervention

PROMPT = [3, 14, 15, 92, 65, 35]


def _counts(model) -> dict:
    return moebench.dispatch(model)  # attention and MoE of every layer


def _reset(model) -> None:
    executor(model).reset_counts()


@pytest.mark.parametrize("fused", [True, False])
def test_compiled_decode_matches_eager_tokens_logits_and_counters(quantized_checkpoint, fused):
    model, _ = moebench.load(quantized_checkpoint)
    with moebench.fused_moe(fused, model):
        _reset(model)
        eager = generate(model, PROMPT, 12)
        eager_counts = _counts(model)
        _reset(model)
        compiled = generate(model, PROMPT, 12, compiled=True)
        assert compiled.token_ids == eager.token_ids
        assert _counts(model) == eager_counts
        _reset(model)
        again = generate(model, PROMPT, 12, compiled=True)  # reuses the traced graph: still counts every step
        assert again.token_ids == eager.token_ids and _counts(model) == eager_counts


def test_new_weights_are_traced_again(quantized_checkpoint):
    model, _ = moebench.load(quantized_checkpoint)
    before = generate(model, PROMPT, 8, compiled=True).token_ids
    norm = model.model.norm
    norm.weight = mx.linspace(-1.0, 1.0, norm.weight.size)  # edited weights: a new array
    eager = generate(model, PROMPT, 8).token_ids
    assert eager != before  # the edit changes what the model decodes ...
    assert generate(model, PROMPT, 8, compiled=True).token_ids == eager  # ... and the compiled step sees it


def test_compiled_step_logits_match_eager_cache(quantized_checkpoint):
    from moebench.decode.cache import make_cache

    model, _ = moebench.load(quantized_checkpoint)
    ex = executor(model)
    fast = CompiledForward(ex, 32)
    cache = make_cache(len(model.layers))
    tokens = mx.array(PROMPT, dtype=mx.uint32)
    a, b = fast(tokens, ex.settings)[0], model(tokens[None], cache)[0, -1]
    for tok in (7, 8, 9):
        assert mx.allclose(a, b, atol=1e-5).item()
        t = mx.array([tok], dtype=mx.uint32)
        a, b = fast(t, ex.settings)[0], model(t[None], cache)[0, -1]
    assert fast.position == len(PROMPT) + 3
    with pytest.raises(ValueError, match="exceeds the compiled cache"):
        fast(mx.zeros((fast.capacity,), dtype=mx.uint32), ex.settings)


def test_recording_runs_eagerly_and_interventions_compile(quantized_checkpoint):
    """Recording declines the compiled step; an intervention is part of the plan, so it compiles (its own traced
    step) and decodes the eager path's tokens, which differ from the unintervened ones."""
    model, _ = moebench.load(quantized_checkpoint)
    assert compile_blocker(False) is None
    assert "recording" in compile_blocker(True)
    plain = generate(model, PROMPT, 6, compiled=True).token_ids
    block = next(iter(model.moe_blocks().values()))
    for intervention in (Intervention(top_k=1), Intervention(force_experts=(0, 1)), Intervention(ablate=(0,))):
        block.intervention = intervention
        eager = generate(model, PROMPT, 6, compiled=False)
        assert generate(model, PROMPT, 6, compiled=True).token_ids == eager.token_ids
    block.intervention = Intervention(force_experts=(2, 3))
    assert generate(model, PROMPT, 6, compiled=True).token_ids != plain
    block.intervention = None


def test_each_call_schedules_the_previous_call_first(quantized_checkpoint, monkeypatch):
    """A GPU step writes the cache in place, in an order MLX's graph does not see: steps must run in call
    order even when a token is not built from the last logits (a forced token here)."""
    model, _ = moebench.load(quantized_checkpoint)
    scheduled, real = [], mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: (scheduled.append(arrays), real(*arrays)))
    ex = executor(model)
    forward = CompiledForward(ex, 16)
    first = forward(mx.array(PROMPT, dtype=mx.uint32), ex.settings)[0]
    assert scheduled == []
    second = forward(mx.array([4], dtype=mx.uint32), ex.settings)[0]
    forward(mx.array([5], dtype=mx.uint32), ex.settings)
    assert len(scheduled) == 2 and scheduled[0][0] is first and scheduled[1][0] is second


def test_a_chunked_prompt_holds_the_cache_once(tmp_path, monkeypatch):
    """Each prompt chunk after the first attends over the slots before it, read from the cache's buffers; its
    commit must then update the buffers where they are, not copy them: the prefill's peak beyond the model and the
    cache stays well under one more cache (a copy of both buffers at every later chunk added a whole cache)."""
    import gc

    from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

    # many key/value heads over many layers: the cache outweighs a chunk's activations
    config = qwen2_moe_config(num_hidden_layers=16, hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                              torch_dtype="float32")
    model, _ = moebench.load(write_random_checkpoint(tmp_path / "ckpt", config, seed=1, bits=4))
    monkeypatch.setattr("moebench.decode.compiled.PREFILL_CHUNK", 256)
    ex = executor(model)
    n = 2048
    fast = CompiledForward(ex, n + 1)
    cache = 2 * fast.cache.keys.nbytes
    mx.eval(fast.cache.arrays())
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    logits, _ = fast(mx.arange(n, dtype=mx.uint32) % config["vocab_size"], ex.settings)
    mx.eval(logits, fast.cache.arrays())
    beyond = mx.get_peak_memory() - before
    assert beyond < 0.6 * cache, f"{beyond / 1e6:.0f} MB beyond the model and its {cache / 1e6:.0f} MB cache"
