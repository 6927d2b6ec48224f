"""Bad decode inputs raise a moebench error naming the argument before MLX sees them; the length is checked against
max_position_embeddings; logits holding NaN or Inf never become a token; a switch or intervention changed during
generate_tokens applies to the very next token. Cases that could crash the process run in
tests/test_bad_input_corpus.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.decode.loop import generate, generate_tokens
from moebench.decode.sampling import Sampling
from moebench.errors import DecodeError, NonFiniteError
from moebench.execution.executor import executor, set_fused_moe
from moebench.inspect.interventions import clear_interventions, set_interventions
from moebench.inspect.record import Stepper
from moebench.tools.writer import qwen2_moe_config

PROMPT = [12, 200, 7, 7, 31, 90]


@pytest.fixture(scope="module")
def model(float_checkpoint):
    return moebench.load(float_checkpoint)[0]


@pytest.fixture(scope="module")
def qmodel(quantized_checkpoint):
    """4-bit: the fused kernels run (their CPU reference) on single-token steps."""
    return moebench.load(quantized_checkpoint)[0]


@pytest.fixture
def short_model(make_checkpoint):
    """The tiny model with max_position_embeddings 16."""
    return moebench.load(make_checkpoint("short", config=qwen2_moe_config(max_position_embeddings=16)))[0]


@pytest.mark.parametrize("prompt", [np.array(PROMPT), np.array(PROMPT, dtype=np.uint16), mx.array(PROMPT),
                                    tuple(PROMPT), [np.int64(t) for t in PROMPT]])
def test_prompt_ids_as_arrays_decode_like_a_list(model, prompt):
    assert generate(model, prompt, 4).token_ids == generate(model, PROMPT, 4).token_ids


@pytest.mark.parametrize("prompt, message", [
    ([], "empty"),
    (np.array([], dtype=np.int64), "empty"),
    ("def f():", "is text"),
    ([[12, 200]], "flat sequence"),
    (mx.array([PROMPT]), "shape \\(1, 6\\)"),
    ([[12], [200, 7]], "flat sequence"),
    ([12, 2.5], "float64"),
    ([12.0, 3.0], "float64"),
    ([True, False], "bool"),
    ([12, "a"], "flat sequence"),
    ([12, None], "object"),
    ([2**70], "object"),
    ([-1], "token id -1 is outside"),
    ([256], "token id 256 is outside the model's vocabulary of 256"),
    ([10**6], "token id 1000000"),
    (mx.array([1.5]), "float32"),
    (5, "shape \\(\\)"),
])
def test_bad_prompts_are_named(model, prompt, message):
    with pytest.raises(DecodeError, match=message):
        generate(model, prompt, 2)


@pytest.mark.parametrize("name, value", [("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 3.5),
                                         ("max_tokens", "3"), ("max_tokens", True), ("max_tokens", None),
                                         ("ahead", 0), ("ahead", 1.0)])
def test_counts_must_be_integers_of_at_least_one(model, name, value):
    kwargs = {"max_tokens": 3, "ahead": 2, name: value}
    with pytest.raises(DecodeError, match=f"{name} must be at least 1"):
        generate(model, PROMPT, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"sampling": "greedy"}, "sampling must be a moebench.Sampling"),
    ({"sampling": {"temperature": 1.0}}, "sampling must be a moebench.Sampling"),
    ({"stop_ids": "ab"}, "stop_ids must be a sequence of integer token ids"),
    ({"stop_ids": [1.5]}, "stop_ids"),
    ({"stop_ids": 3}, "stop_ids"),
    ({"stop_ids": [True]}, "stop_ids"),
    ({"compiled": "yes"}, "compiled must be True, False or None"),
    ({"compiled": 1}, "compiled must be True, False or None"),
])
def test_bad_decode_arguments_are_named(model, kwargs, message):
    with pytest.raises(DecodeError, match=message):
        generate(model, PROMPT, 3, **kwargs)


@pytest.mark.parametrize("fields, message", [
    ({"temperature": "1"}, "temperature must be a number"),
    ({"temperature": None}, "temperature must be a number"),
    ({"temperature": True}, "temperature must be a number"),
    ({"temperature": 1e-45}, "below 1e-06"),
    ({"temperature": 5e-7}, "below 1e-06"),
    ({"temperature": float("nan")}, "finite"),
    ({"temperature": float("inf")}, "finite"),
    ({"temperature": -1.0}, ">= 0"),
    ({"top_p": "x"}, "top_p must be a number"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"repetition_penalty": 1e-45}, "repetition_penalty must be a finite number >= 1e-06"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": "2"}, "repetition_penalty must be a number"),
    ({"seed": "x"}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"repetition_context": 0}, "repetition_context"),
])
def test_bad_sampling_settings_are_named(fields, message):
    with pytest.raises(DecodeError, match=message):
        Sampling(**fields)


def test_the_smallest_temperature_still_samples_like_greedy(model):
    # 1e-6 is accepted and keeps every logit finite: the likeliest token wins, as at temperature 0
    coldest = generate(model, PROMPT, 6, Sampling(temperature=1e-6, seed=3))
    assert coldest.token_ids == generate(model, PROMPT, 6).token_ids


def test_a_decode_past_max_position_embeddings_is_refused(short_model):
    assert len(generate(short_model, PROMPT, 11).token_ids) == 11  # 6 + 10 fed positions: exactly 16
    for prompt, n in ((PROMPT, 12), ([1] * 17, 1), ([1] * 16, 2)):
        with pytest.raises(DecodeError, match="past the model's max_position_embeddings of 16"):
            generate(short_model, prompt, n)
    with pytest.raises(DecodeError, match="max_position_embeddings of 16"):
        generate(short_model, PROMPT, 10**8, compiled=True)


def test_argmax_picks_nan_and_inf_wherever_they_are():
    """What the greedy finite flag relies on (decode.loop.finite_or_flag): MLX's argmax, as numpy's, returns a NaN
    or a +Inf wherever one is, so the chosen token's logit is finite only when no logit is NaN or +Inf."""
    for bad in (float("nan"), float("inf")):
        for where in (0, 1, 700, 4095):
            logits = np.linspace(-3, 3, 4096).astype(np.float32)
            logits[where] = bad
            assert int(mx.argmax(mx.array(logits))) == where
    both = np.zeros(4096, dtype=np.float32)
    both[[5, 9]] = [np.inf, np.nan]
    assert not np.isfinite(both[int(mx.argmax(mx.array(both)))])


@pytest.fixture
def poisoned(float_checkpoint):
    """A model whose final norm holds one NaN, set after loading (what load's check would refuse)."""
    model = moebench.load(float_checkpoint)[0]
    weight = model.model.norm.weight
    model.model.norm.weight = mx.where(mx.arange(weight.size) == 3, mx.nan, weight)
    return model


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, seed=1), Sampling(repetition_penalty=1.3),
                                      Sampling(temperature=1.0, top_k=5, top_p=0.9, seed=2)])
def test_nan_logits_never_become_a_token(poisoned, compiled, sampling):
    with pytest.raises(NonFiniteError, match="logits at position 5 hold NaN or Inf"):
        generate(poisoned, PROMPT, 4, sampling, compiled=compiled)
    assert sum(sum(d["fused"].values()) + d["fallback"] for d in moebench.dispatch(poisoned)["moe"].values()) == 0


def test_inf_in_a_single_logit_is_caught(model):
    """One token's output row at Inf (a checkpoint's lm_head) gives that logit +Inf or NaN: flagged."""
    head = model.lm_head.weight
    try:
        model.lm_head.weight = mx.where((mx.arange(head.shape[0]) == 40)[:, None], mx.inf, head)
        with pytest.raises(NonFiniteError):
            generate(model, PROMPT, 2)
    finally:
        model.lm_head.weight = head


def _moe_counts(model) -> list[tuple[int, int]]:
    """Per MoE layer: (fused runs, fallbacks)."""
    return [(sum(d["fused"].values()), d["fallback"]) for d in moebench.dispatch(model)["moe"].values()]


def test_a_switch_flipped_during_generate_tokens_applies_to_the_next_token(qmodel):
    executor(qmodel).reset_counts()
    tokens = []
    try:
        for i, (tid, _) in enumerate(generate_tokens(qmodel, PROMPT, 8)):
            tokens.append(tid)
            if i == 2:
                set_fused_moe(False, qmodel)
    finally:
        set_fused_moe(True, qmodel)
    # prefill (a fallback: 6 tokens) and tokens 1, 2 fused; tokens 3..7 switched off, none queued under the old switch
    assert _moe_counts(qmodel) == [(2, 6)] * len(qmodel.moe_blocks())
    first = generate(qmodel, PROMPT, 3).token_ids
    with moebench.fused_moe(False, qmodel):
        assert tokens == first + generate(qmodel, PROMPT + first, 5).token_ids


def test_an_intervention_set_during_generate_tokens_applies_to_the_next_token(model):
    forced = moebench.Intervention(force_experts=(1, 2))
    reference = Stepper(model, None, PROMPT, pipeline=False)  # one step at a time: nothing queued
    try:
        expected = [reference.prefill()[-1].token_id] + [reference.step().token_id for _ in range(2)]
        set_interventions(model, forced)
        expected += [reference.step().token_id for _ in range(3)]
    finally:
        clear_interventions(model)
    got = []
    try:
        for i, (tid, _) in enumerate(generate_tokens(model, PROMPT, 6, compiled=False)):
            got.append(tid)
            if i == 2:
                set_interventions(model, forced)
    finally:
        clear_interventions(model)
    assert got == expected
    assert got[3:] != generate(model, PROMPT, 6).token_ids[3:]  # the intervention changed them


def test_an_intervention_set_during_a_compiled_decode_applies_to_the_next_token(model):
    """As on the eager path: the queued steps are rolled back and built again under the intervention."""
    expected = []
    for compiled in (False, True):
        stream = generate_tokens(model, PROMPT, 6, compiled=compiled)
        got = [next(stream)[0] for _ in range(2)]
        set_interventions(model, moebench.Intervention(force_experts=(1, 2)))
        try:
            got += [tid for tid, _ in stream]
        finally:
            clear_interventions(model)
        expected.append(got)
    assert expected[0] == expected[1]
