import asyncio

import pytest

import moebench
from moebench.errors import DecodeError
from moebench.inspect.record import Stepper
from moebench.widgets.live import AFTER_TOGGLE_TOKENS, LiveDecode


def test_synchronous_run_feeds_chart_views_and_label(tiny):
    model, tokenizer = tiny
    moebench.set_fused_moe(True)
    seen = []
    live = LiveDecode(Stepper(model, tokenizer, "hello", record=False), views=[seen.append])
    live.run(3)
    live.record_box.value = True
    records = live.run(2)
    assert live.decoded == live.chart.points_received == 5 and seen[-2:] == records
    assert len(live.chart.trace(False).x) == 3 and len(live.chart.trace(True).x) == 2
    assert f"fused {moebench.available_backend()} kernel" in live.toggle.label.value
    assert live.status.value.startswith("5 tokens decoded")


def test_flipping_the_toggle_marks_the_chart_and_decodes_on_the_other_path(tiny):
    model, tokenizer = tiny
    moebench.set_fused_moe(True)
    live = LiveDecode(Stepper(model, tokenizer, "hello", record=True))
    live.run(2)
    live.toggle.set(False)
    assert live.decoded == 2 + AFTER_TOGGLE_TOKENS
    assert "switched off" in live.toggle.label.value
    assert [a.text for a in live.chart.figure.layout.annotations] == ["fused OFF"]


def test_the_async_task_yields_between_tokens(tiny):
    model, tokenizer = tiny
    live = LiveDecode(Stepper(model, tokenizer, "hello"))
    progress = []

    async def main():
        task = live.start(5)
        while not task.done():
            progress.append(live.decoded)
            await asyncio.sleep(0)
        return await task

    records = asyncio.run(main())
    assert len(records) == 5 and not live.running
    assert len(set(progress)) > 2  # other code ran between tokens


def test_a_live_decode_without_a_token_count_runs_until_stopped_or_its_time_is_up(tiny):
    model, tokenizer = tiny
    live = LiveDecode(Stepper(model, tokenizer, "hello", stop_ids=()))
    assert live.count.value == 0  # the button's default: decode until stop is pressed

    async def until_stopped():
        task = live.start()
        while live.decoded < 12:  # far past any fixed count a test would pick, then stop
            await asyncio.sleep(0)
        live.stop()
        return await task

    async def timed():
        return await live.start(seconds=0.05)

    records = asyncio.run(until_stopped())
    assert len(records) >= 12 and not live.running
    assert asyncio.run(timed()) and not live.running  # ends by itself


def test_start_refuses_a_limit_that_is_not_positive(tiny):
    model, tokenizer = tiny
    live = LiveDecode(Stepper(model, tokenizer, "hello"))
    for bad in ({"n": 0}, {"seconds": -1.0}):
        with pytest.raises(DecodeError, match=next(iter(bad))):
            live.start(**bad)
    assert not live.running


def test_a_decode_that_reaches_its_end_says_so(tiny):
    model, tokenizer = tiny
    live = LiveDecode(Stepper(model, tokenizer, "hello", max_tokens=2, stop_ids=()))
    assert len(live.run(5)) < 5 and live.stepper.done and "reached its end" in live.status.value


def test_a_restart_on_another_model_empties_the_chart_and_names_the_model(tiny, tiny_no_shared):
    model, tokenizer = tiny
    live = LiveDecode(Stepper(model, tokenizer, "hello", record=True, stop_ids=()))
    live.run(3)
    live.restart(Stepper(model, tokenizer, "again", record=True, stop_ids=()))  # a new prompt: the chart goes on
    assert live.chart.points_received == 3 and len(live.chart.trace(True).x) == 3
    other, other_tokenizer = tiny_no_shared
    live.restart(Stepper(other, other_tokenizer, "hello", stop_ids=()), tokens=2)
    assert live.stepper.model is other and len(live.stepper.trace.generated) == 1 + 2  # the prompt's, then 2
    assert len(live.chart.trace(True).x) == 2  # only the new model's tokens: rates of two models do not compare
    assert other.load_info.source.name in live.text.value and "no token decoded yet" not in live.toggle.label.value


def test_a_restart_during_a_live_decode_waits_for_it_to_stop(tiny, tiny_no_shared):
    """A model picked while the panel decodes live (the picker's callback runs between two tokens): the decode stops
    after its current token, then the panel switches to the new model."""
    model, tokenizer = tiny
    other, other_tokenizer = tiny_no_shared

    async def main():
        live = LiveDecode(Stepper(model, tokenizer, "hello", stop_ids=()))
        task = live.start()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        live.restart(Stepper(other, other_tokenizer, "hello", stop_ids=()))
        assert live.stepper.model is model  # not while it runs
        records = await asyncio.wait_for(task, 60)
        return live, records

    live, records = asyncio.run(main())
    assert records and live.stepper.model is other and not live.running
    assert "no token decoded yet on" in live.toggle.label.value and live.chart.points_received == len(records)
    assert len(live.chart.trace(False).x) == 0
