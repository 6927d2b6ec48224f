"""Widget callbacks may come on a kernel subshell thread; every decode must still run on the thread whose
MLX streams the stepper's arrays live on (issue 22's crash: 'There is no Stream(cpu, 0) in current thread')."""

import asyncio
import threading

import moebench
from moebench.inspect.record import Stepper
from moebench.widgets.live import AFTER_TOGGLE_TOKENS, LiveDecode


def on_thread(action) -> None:
    """Run `action` on another thread (as ipykernel runs a comm handler on a subshell) and wait for it."""
    errors = []

    def target():
        try:
            action()
        except Exception as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    assert not errors, errors


async def loop_turns(turns: int = 10) -> None:
    """Let the event loop take `turns` turns: a callback another thread queued (call_soon_threadsafe) runs in the
    first, so what the test checks next is the state after it, however slow the machine (no waiting by the clock)."""
    for _ in range(turns):
        await asyncio.sleep(0)


def test_a_flip_while_idle_decodes_on_the_owner_thread_not_the_callers(tiny):
    model, tokenizer = tiny
    moebench.set_fused_moe(True)

    async def main():
        threads = []
        live = LiveDecode(Stepper(model, tokenizer, "hello", stop_ids=()),
                          views=[lambda _: threads.append(threading.current_thread())])
        live.run(2)
        on_thread(lambda: live.toggle.set(False))
        assert live.decoded == 2  # nothing decoded on the callback's thread
        await loop_turns()  # a turn of the loop runs the queued decode
        return live, threads

    live, threads = asyncio.run(main())
    assert live.decoded == 2 + AFTER_TOGGLE_TOKENS and set(threads) == {threading.main_thread()}
    assert not live.stepper.trace.steps[-1].fused_switch
    assert [a.text for a in live.chart.figure.layout.annotations] == ["fused OFF"]


def test_flips_during_a_synchronous_run_act_from_the_next_token(tiny):
    model, tokenizer = tiny
    moebench.set_fused_moe(True)

    async def main():
        live = LiveDecode(Stepper(model, tokenizer, "hello", stop_ids=(), record=True))

        def view(record):
            if live.decoded == 3:
                on_thread(lambda: live.toggle.set(False))
            if live.decoded == 6:
                on_thread(lambda: setattr(live.record_box, "value", False))

        live.views.append(view)
        records = live.run(10)
        await loop_turns()  # whatever the flips queued has run
        return live, records

    live, records = asyncio.run(main())
    assert live.decoded == 10  # a flip while a decode runs adds no tokens of its own
    assert [r.fused_switch for r in records] == [True] * 3 + [False] * 7
    assert [bool(r.layers) for r in records] == [True] * 6 + [False] * 4
    marks = {a.text: a.x for a in live.chart.figure.layout.annotations}
    assert marks == {"fused OFF": records[3].position, "recording OFF": records[6].position}


def test_flips_during_an_awaited_task_act_between_tokens(tiny):
    model, tokenizer = tiny
    moebench.set_fused_moe(True)

    async def main():
        live = LiveDecode(Stepper(model, tokenizer, "hello", stop_ids=(), record=True))
        task = live.start(30)
        while live.decoded < 5:
            await asyncio.sleep(0)
        on_thread(lambda: live.toggle.set(False))
        on_thread(lambda: setattr(live.record_box, "value", False))
        records = await task
        return live, records

    live, records = asyncio.run(main())
    switched = [r.fused_switch for r in records]
    assert len(records) == 30 and live.decoded == 30 and switched[0] and not switched[-1]
    first_off = switched.index(False)
    assert first_off < 12 and not records[-1].layers  # acted within a few tokens, long before the end
    assert "30 tokens decoded" in live.status.value


def test_stop_from_another_thread_ends_the_run_after_the_current_token(tiny):
    model, tokenizer = tiny

    async def main():
        live = LiveDecode(Stepper(model, tokenizer, "hello", stop_ids=()))
        task = live.start(1000)
        while live.decoded < 5:
            await asyncio.sleep(0)
        on_thread(live.stop_button.click)
        return live, await task

    live, records = asyncio.run(main())
    assert 5 <= len(records) < 20 and not live.running and live.decoded == len(records)
