import asyncio

import moebench
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
