"""Live decoding into the widgets: an asyncio task that yields between tokens, and its synchronous twin.

`run(n)` decodes n tokens in the calling cell (what CI executes); `start(n)` returns an asyncio task
that decodes the same way but gives the notebook's event loop a turn after every token, so buttons
(the fused toggle, 'record internals') act between tokens. Await the task before reading its result:
a task keeps running after its cell returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import ipywidgets as widgets

from .toggle import FusedToggle
from .tps import TokensPerSecondChart

AFTER_TOGGLE_TOKENS = 8


def instrumented(record) -> bool:
    """Whether internals were recorded for this token (an unrecorded step has no layer records)."""
    return bool(record.layers)


class LiveDecode:
    """Decode with a record.Stepper and feed every token to the chart, the toggle and any `views`.

    Flipping the toggle marks the chart; when no decode is running it also decodes a few tokens so
    the new path shows up at once in the label and the chart.
    """

    def __init__(self, stepper, chart: TokensPerSecondChart | None = None, toggle: FusedToggle | None = None,
                 views: list[Callable[[object], None]] = ()):
        self.stepper = stepper
        self.chart = chart or TokensPerSecondChart()
        self.toggle = toggle or FusedToggle()
        self.toggle.on_change(self._toggled)
        self.views = list(views)
        self.decoded = 0
        self.running = False
        self.record_box = widgets.Checkbox(value=stepper.record, description="record internals (slower)",
                                           indent=False)
        self.record_box.add_class("moebench-record-toggle")
        self.record_box.observe(self._record_changed, names="value")
        self.status = widgets.HTML()
        self.widget = widgets.VBox([widgets.HBox([self.toggle.widget]), self.record_box, self.chart.figure,
                                    self.status])
        if not stepper.prefilled:
            stepper.prefill()

    def _one(self) -> object:
        record = self.stepper.step()
        self.decoded += 1
        self.chart.add(record.position, record.seconds, instrumented(record))
        self.toggle.show(record)
        for view in self.views:
            view(record)
        return record

    def _finish(self) -> None:
        self.chart.flush()
        self.status.value = (f"{self.decoded} tokens decoded. {self.chart.summary(True)}; "
                             f"{self.chart.summary(False)}")

    def run(self, n: int) -> list:
        """Decode n tokens now (synchronously); returns their records."""
        if self.running:
            raise RuntimeError("a live decode task is running: await it (or wait) before run()")
        records = [self._one() for _ in range(n) if not self.stepper.done]
        self._finish()
        return records

    def start(self, n: int) -> asyncio.Task:
        """Decode n tokens as an asyncio task that yields to the event loop between tokens."""
        if self.running:
            raise RuntimeError("a live decode task is already running")
        self.running = True

        async def loop() -> list:
            records = []
            try:
                for _ in range(n):
                    if self.stepper.done:
                        break
                    records.append(self._one())
                    await asyncio.sleep(0)
            finally:
                self.running = False
                self._finish()
            return records

        return asyncio.ensure_future(loop())

    def _toggled(self, enabled: bool) -> None:
        self.chart.mark(self._next_position(), "fused ON" if enabled else "fused OFF")
        if not self.running and not self.stepper.done:
            self.run(AFTER_TOGGLE_TOKENS)

    def _record_changed(self, change) -> None:
        self.stepper.record = change["new"]
        self.chart.mark(self._next_position(), "recording ON" if change["new"] else "recording OFF")

    def _next_position(self) -> int:
        return self.stepper.trace.steps[-1].position + 1

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
