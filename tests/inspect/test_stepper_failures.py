"""A Stepper stays consistent when a call fails: a KeyboardInterrupt at any line of moebench while it steps, or an
error (NaN logits) from the model, leaves it at its last whole step, and continuing gives the tokens, records and
dispatch counts of a decode that was never interrupted. Its arguments are checked when given."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

import moebench
from moebench.errors import DecodeError, NonFiniteError
from moebench.execution.executor import executor
from moebench.inspect.record import Stepper
from moebench.tools.writer import qwen2_moe_config

PROMPT = [12, 200, 7, 7, 31, 90]
TOKENS = 10
PACKAGE = str(Path(moebench.__file__).parent)


@pytest.fixture(scope="module")
def model(quantized_checkpoint):
    return moebench.load(quantized_checkpoint)[0]


def _counts(model) -> list:
    return [(dict(d["fused"]), d["fallback"]) for d in moebench.dispatch(model)["moe"].values()]


@pytest.fixture(scope="module")
def reference(model):
    """Tokens, per-position inputs and dispatch counts of an uninterrupted decode."""
    executor(model).reset_counts()
    trace = Stepper(model, None, PROMPT, record=True).run(TOKENS)
    return trace.token_ids, [s.input_id for s in trace.steps], _counts(model)


class InterruptAt:
    """A trace function that raises KeyboardInterrupt at the `at`-th line moebench executes: any line but those of
    Stepper._end and the counting it calls, where a step finished and counted is being marked whole (an interrupt
    there can count it twice: the one window the Stepper's docstring names)."""

    def __init__(self, at: int):
        self.at, self.lines = at, 0

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PACKAGE) or frame.f_code.co_name in ("_end", "count"):
            return None
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                raise KeyboardInterrupt
        return self


def _interrupted(model, call: str, at: int) -> Stepper:
    stepper = Stepper(model, None, PROMPT, record=True, max_tokens=TOKENS)
    if call == "step":
        stepper.prefill()
        stepper.step()
    sys.settrace(InterruptAt(at))
    try:
        getattr(stepper, call)()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return stepper


@pytest.mark.parametrize("call", ["prefill", "step"])
def test_an_interrupt_at_any_line_leaves_the_last_whole_step(model, reference, call):
    tokens, inputs, counts = reference
    lines = InterruptAt(10**9)
    stepper = Stepper(model, None, PROMPT, record=True, max_tokens=TOKENS)
    if call == "step":
        stepper.prefill()
        stepper.step()
    sys.settrace(lines)
    getattr(stepper, call)()
    sys.settrace(None)
    assert lines.lines > 100
    for at in range(1, lines.lines + 1, max(1, lines.lines // 60)):
        executor(model).reset_counts()
        stepper = _interrupted(model, call, at)
        whole = len(stepper.trace.steps)  # every layer at the last whole step (and its speculative next one)
        assert {c.offset for c in stepper.session.cache} in ({whole}, {whole + 1}), at
        for _ in stepper:
            pass
        assert stepper.trace.token_ids == tokens, at
        assert [s.input_id for s in stepper.trace.steps] == inputs, at
        assert _counts(model) == counts, at


def test_nan_logits_leave_the_stepper_whole_and_it_continues(model, reference):
    tokens, _, _ = reference
    stepper = Stepper(model, None, PROMPT, max_tokens=TOKENS, pipeline=False)  # no step built before the NaN
    stepper.prefill()
    stepper.step()
    norm = model.model.norm.weight
    model.model.norm.weight = mx.full(norm.shape, mx.nan)
    try:
        for _ in range(2):  # refused again: nothing of the failed step stayed behind
            with pytest.raises(NonFiniteError, match="hold NaN or Inf"):
                stepper.step()
            assert len(stepper.trace.steps) == len(PROMPT) + 1 and not stepper.done
    finally:
        model.model.norm.weight = norm
    for _ in stepper:
        pass
    assert stepper.trace.token_ids == tokens


def test_a_teacher_forced_token_after_a_failure(model):
    stepper = Stepper(model, None, PROMPT)
    stepper.prefill()
    with pytest.raises(DecodeError, match="feed token id 256 is not an id of the vocabulary 0..255"):
        stepper.step(feed=256)
    record = stepper.step(feed=5)
    assert record.input_id == 5 and record.position == len(PROMPT)


@pytest.mark.parametrize("feed", [-1, 10**6, 2**63, 1.5, "3", True, None])
def test_bad_feed_tokens_are_named(model, feed):
    stepper = Stepper(model, None, PROMPT)
    stepper.prefill()
    if feed is None:
        assert stepper.step(feed=None).input_id == stepper.trace.token_ids[0]
        return
    with pytest.raises(DecodeError, match="feed token id"):
        stepper.step(feed=feed)


@pytest.mark.parametrize("kwargs, message", [
    ({"top": -1}, "top must be an integer"), ({"top": 257}, "top must be an integer"), ({"top": 2.0}, "top"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer"), ({"max_tokens": "3"}, "max_tokens"),
    ({"fused": "off"}, "fused must be True, False or None"), ({"fused": 1}, "fused"),
    ({"sampling": "greedy"}, "sampling must be a moebench.Sampling"),
    ({"stop_ids": [1.5]}, "stop_ids"), ({"stop_ids": "ab"}, "stop_ids"),
])
def test_bad_stepper_arguments_are_named(model, kwargs, message):
    with pytest.raises(DecodeError, match=message):
        Stepper(model, None, PROMPT, **kwargs)


@pytest.mark.parametrize("n", [0, -1, 2.5, "3", True])
def test_run_needs_a_count(model, n):
    with pytest.raises(DecodeError, match="n must be an integer >= 1"):
        Stepper(model, None, PROMPT).run(n)


def test_no_step_past_max_position_embeddings(make_checkpoint):
    model = moebench.load(make_checkpoint("short", config=qwen2_moe_config(max_position_embeddings=8)))[0]
    with pytest.raises(DecodeError, match="past the model's max_position_embeddings of 8"):
        Stepper(model, None, list(range(9)))
    with pytest.raises(DecodeError, match="past the model's max_position_embeddings of 8"):
        Stepper(model, None, PROMPT).run(4)  # 6 prompt positions + 3 fed tokens
    stepper = Stepper(model, None, PROMPT)
    stepper.prefill()
    stepper.step()
    stepper.step()  # 8 positions: the limit
    with pytest.raises(DecodeError, match="holds 8 positions, the model's max_position_embeddings"):
        stepper.step()
    assert len(stepper.trace.steps) == 8 and {c.offset for c in stepper.session.cache} == {8}
