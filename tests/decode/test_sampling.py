"""Sampling settings: top-k, top-p, temperature and the repetition penalty shape the logits exactly as
transformers' logits processors do (the meaning generation_config.json's values have), and a checkpoint's
generation_config.json becomes a Sampling the way transformers reads it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.config import GenerationConfig
from moebench.decode.sampling import DecodeError, Sampling, sample, sampling_logits, seen_tokens

VOCAB = 64
HISTORY = [[3, 7, 7, 60, 12, 3], [0, 1, 2, 3, 4, 5]]


def random_logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (2, VOCAB)).astype(np.float32)


def transformers_logits(logits: np.ndarray, history: list[list[int]], s: Sampling) -> np.ndarray:
    torch = pytest.importorskip("torch", reason="the reference is transformers' logits processors (needs torch)")
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids, scores = torch.tensor(history), torch.tensor(logits)
    processors = [RepetitionPenaltyLogitsProcessor(s.repetition_penalty), TemperatureLogitsWarper(s.temperature)]
    processors += [TopKLogitsWarper(s.top_k)] if s.top_k else []
    processors += [TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []
    for processor in processors:
        scores = processor(ids, scores)
    return scores.numpy()


@pytest.mark.parametrize("settings", [
    dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),  # Qwen1.5-Chat's generation_config
    dict(temperature=0.6, top_p=0.95, top_k=20),  # Qwen3's
    dict(temperature=1.3, top_k=3, repetition_penalty=1.5),
    dict(temperature=0.9, top_p=0.5, repetition_penalty=0.8),
    dict(temperature=1.0, top_k=VOCAB + 5),
])
def test_logits_match_transformers_processors(settings):
    s = Sampling(seed=0, **settings)
    logits = random_logits()
    got = np.array(sampling_logits(mx.array(logits), s, mx.array(HISTORY)))
    want = transformers_logits(logits, HISTORY, s)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6, atol=1e-6)


def test_sampled_tokens_stay_inside_top_k_and_follow_the_seed():
    logits = mx.array(random_logits(1)[:1])
    s = Sampling(temperature=5.0, top_k=4, seed=3)
    allowed = set(np.argsort(-np.array(logits[0]))[:4].tolist())
    keys = mx.random.split(mx.random.key(3), 200)
    drawn = [sample(logits, s, k).item() for k in keys]
    assert set(drawn) == allowed  # hot enough that every kept token shows up
    assert drawn == [sample(logits, s, k).item() for k in keys]


def test_penalty_changes_greedy_choice_and_needs_history():
    logits = mx.array([[2.0, 1.9, -1.0, 0.0]])
    s = Sampling(repetition_penalty=1.2)
    assert sample(logits, Sampling()).item() == 0
    assert sample(logits, s, history=mx.array([0, 0])).item() == 1  # 2.0 / 1.2 < 1.9
    assert sample(logits, Sampling(repetition_penalty=1.2, repetition_context=1), history=mx.array([0, 3])).item() == 0
    with pytest.raises(DecodeError, match="repetition_penalty needs the tokens seen so far"):
        sample(logits, s)
    assert s.uses_history and not Sampling(temperature=1.0, top_k=5).uses_history


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(top_k=2.0), dict(top_k=True), dict(repetition_penalty=0),
                                 dict(repetition_penalty=float("nan")), dict(repetition_context=0),
                                 dict(top_p=0), dict(temperature=-1)])
def test_bad_settings_are_named(bad):
    with pytest.raises(DecodeError, match=next(iter(bad))):
        Sampling(**bad)


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30, True, 1.0, "3", np.int64(3)])
def test_seeds_mlx_and_numpy_cannot_take_are_named(seed):
    with pytest.raises(DecodeError, match=r"seed must be an integer from 0 to 2\*\*64 - 1"):
        Sampling(temperature=1.0, seed=seed)


@pytest.mark.parametrize("seed", [0, 2**63, 2**64 - 1, None])
def test_every_64_bit_seed_samples(seed):
    token = sample(mx.array([[0.0, 1.0, 2.0]]), Sampling(temperature=1.0, seed=seed),
                   mx.random.key(seed) if seed is not None else None)
    assert 0 <= token.item() < 3


def test_generation_config_read_as_transformers_reads_it():
    qwen3 = GenerationConfig((151645, 151643), do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    assert Sampling.from_generation_config(qwen3, seed=1) == Sampling(0.6, 0.95, 1, top_k=20)
    chat15 = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    assert Sampling.from_generation_config(chat15) == Sampling(0.7, 0.8, top_k=20, repetition_penalty=1.05)
    assert Sampling.from_generation_config(GenerationConfig(do_sample=True)) == Sampling(temperature=1.0)
    greedy = GenerationConfig(temperature=0.7, top_k=20, repetition_penalty=1.1)  # no do_sample: greedy
    assert Sampling.from_generation_config(greedy) == Sampling(repetition_penalty=1.1)
    assert Sampling.from_generation_config(GenerationConfig()) == Sampling()


def test_a_loop_keeping_seen_tokens_penalizes_as_transformers_generate():
    """A decode loop that feeds the prompt, then each chosen token, through seen_tokens picks the tokens greedy
    transformers picks with the same penalty (a bigram table stands in for the model)."""
    table = np.random.default_rng(4).normal(0, 1, (VOCAB, VOCAB)).astype(np.float32)
    table[:, 9] += 3.0  # one token every row likes: without the penalty greedy repeats it
    s = Sampling(repetition_penalty=1.8)
    prompt, steps = [5, 9, 2], 12

    history, fed, got = None, mx.array(prompt), []
    for _ in range(steps):
        history = seen_tokens(history, fed, s)
        token = sample(mx.array(table[int(fed[-1].item())])[None], s, history=history)
        got.append(token.item())
        fed = token
    ids, want = list(prompt), []
    for _ in range(steps):
        scores = transformers_logits(table[ids[-1]][None], [ids], Sampling(temperature=1.0, repetition_penalty=1.8))
        want.append(int(np.argmax(scores[0])))
        ids.append(want[-1])
    assert got == want and len(set(got)) > 2
    assert seen_tokens(None, mx.array(prompt), Sampling()) is None
