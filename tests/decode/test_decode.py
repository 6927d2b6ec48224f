"""Greedy and temperature / top-p decoding with the KV cache; seeds make sampling reproducible."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.decode.loop import GenerationResult, generate, generate_tokens
from moebench.decode.sampling import DecodeError, Sampling, sample

PROMPT = [12, 200, 7, 7, 31, 90]


@pytest.fixture(scope="module")
def model(float_checkpoint):
    return moebench.load(float_checkpoint)[0]


def test_greedy_equals_argmax_of_full_forward_passes(model):
    result = generate(model, PROMPT, 12)
    ids = list(PROMPT)
    for _ in range(12):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
    assert result.token_ids == ids[len(PROMPT):]
    assert result.prompt_ids == PROMPT


def test_yielded_logits_are_the_next_token_logits(model):
    steps = list(generate_tokens(model, PROMPT, 3))
    ids = list(PROMPT)
    for tid, logits in steps:
        expected = np.array(model(mx.array([ids]))[0, -1])
        assert np.abs(np.array(logits) - expected).max() < 1e-4
        assert tid == int(np.argmax(expected))
        ids.append(tid)


def test_stops_at_a_stop_token_and_keeps_it(model):
    free = generate(model, PROMPT, 10).token_ids
    stop = free[4]
    first = free.index(stop)
    stopped = generate(model, PROMPT, 10, stop_ids=(stop,))
    assert stopped.token_ids == free[: first + 1]
    with pytest.raises(DecodeError, match=r"max_tokens must be at least 1 \(an integer\), got 0"):
        generate(model, PROMPT, 0)


def test_sampling_with_a_seed_is_reproducible(model):
    hot = Sampling(temperature=1.5, top_p=0.95, seed=11)
    a, b = generate(model, PROMPT, 16, hot), generate(model, PROMPT, 16, hot)
    other = generate(model, PROMPT, 16, Sampling(temperature=1.5, top_p=0.95, seed=12))
    assert a.token_ids == b.token_ids
    assert a.token_ids != other.token_ids
    assert a.token_ids != generate(model, PROMPT, 16).token_ids


@pytest.mark.parametrize("ahead", (1, 3))
def test_steps_queued_ahead_change_no_token_and_no_logit(model, ahead):
    hot = Sampling(temperature=1.5, top_p=0.95, seed=5)
    for sampling in (Sampling(), hot):
        want = list(generate_tokens(model, PROMPT, 9, sampling))
        got = list(generate_tokens(model, PROMPT, 9, sampling, ahead=ahead))
        assert [t for t, _ in got] == [t for t, _ in want]
        assert all(np.array_equal(np.array(a), np.array(b)) for (_, a), (_, b) in zip(got, want, strict=True))
    free = generate(model, PROMPT, 10, ahead=ahead).token_ids
    assert generate(model, PROMPT, 10, stop_ids=(free[2],), ahead=ahead).token_ids == free[: free.index(free[2]) + 1]
    with pytest.raises(DecodeError, match="ahead must be at least 1"):
        generate(model, PROMPT, 4, ahead=0)


def test_tiny_top_p_is_greedy(model):
    greedy = generate(model, PROMPT, 16).token_ids
    assert generate(model, PROMPT, 16, Sampling(temperature=2.0, top_p=1e-6, seed=3)).token_ids == greedy


def test_top_p_keeps_the_smallest_nucleus():
    logits = mx.log(mx.array([[0.05, 0.5, 0.15, 0.3]]))
    keys = mx.random.split(mx.random.key(0), 400)
    drawn = {int(sample(logits, Sampling(temperature=1.0, top_p=0.7), k)[0]) for k in keys}
    assert drawn == {1, 3}  # 0.5 + 0.3 reaches 0.7; 0.15 and 0.05 never come out
    drawn_all = {int(sample(logits, Sampling(temperature=1.0), k)[0]) for k in keys}
    assert drawn_all == {0, 1, 2, 3}
    assert int(sample(logits, Sampling())[0]) == 1


def test_bad_prompts_are_named(model):
    with pytest.raises(DecodeError, match="empty"):
        generate(model, [], 4)
    with pytest.raises(DecodeError, match="token id 256 .* vocabulary of 256"):
        generate(model, [1, 256], 4)
    with pytest.raises(moebench.MoebenchError, match="token id -1"):
        list(generate_tokens(model, [-1], 4))


def test_timings_and_rates():
    r = GenerationResult([1, 2, 3, 4], [5, 6, 7], prompt_seconds=0.5, decode_seconds=0.25)
    assert (r.prompt_tps, r.decode_tps) == (8.0, 8.0)  # the first token comes from prefill
    assert GenerationResult([1], [5]).decode_tps == 0.0


def test_generate_measures_time(model):
    r = generate(model, PROMPT, 5)
    assert r.prompt_seconds > 0 and r.decode_seconds > 0 and r.decode_tps > 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(seed=1.5), "seed"),
])
def test_bad_sampling_settings_are_named(kwargs, message):
    with pytest.raises(DecodeError, match=message):
        Sampling(**kwargs)


def test_the_compiled_step_is_the_default_for_fused_decoding_on_cuda_and_every_decoding_on_the_cpu(monkeypatch):
    from moebench.decode import loop as decode

    model, _ = moebench.load()
    monkeypatch.setattr(decode, "available_backend", lambda: "cuda")
    assert decode.use_compiled(model, None)
    assert not decode.use_compiled(object(), None)  # another engine's model: eager
    with moebench.fused_moe(False, model):
        assert not decode.use_compiled(model, None)
    monkeypatch.setattr(decode, "available_backend", lambda: "reference")  # the CPU: fused or not
    assert decode.use_compiled(model, None)
    with moebench.fused_moe(False, model):
        assert decode.use_compiled(model, None)
    assert not decode.use_compiled(object(), None)
    monkeypatch.setattr(decode, "available_backend", lambda: "metal")
    assert not decode.use_compiled(model, None)
    assert decode.use_compiled(object(), True) and not decode.use_compiled(model, False)


@pytest.mark.parametrize("fused", [True, False])
def test_the_default_decode_on_the_cpu_gives_the_eager_loops_tokens_and_logits_bit_for_bit(quantized_checkpoint,
                                                                                           fused):
    """The CPU decodes through the compiled step by default (faster there, docs/benchmarks/cpu-default-path-
    2026-12-03.md) and computes exactly what the eager loop computes: the same tokens and the same logits."""
    from moebench.execution.executor import executor

    if moebench.available_backend() != "reference":
        pytest.skip("the CPU's default (this machine decodes on a GPU)")
    model, _ = moebench.load(quantized_checkpoint)
    with moebench.fused_moe(fused, model):
        eager = list(generate_tokens(model, PROMPT, 16, compiled=False))
        executor(model).compiled.clear()
        default = list(generate_tokens(model, PROMPT, 16))
    assert executor(model).compiled  # the default ran a traced step
    assert [t for t, _ in default] == [t for t, _ in eager]
    for (_, a), (_, b) in zip(default, eager, strict=True):
        assert np.array_equal(np.array(a), np.array(b))
