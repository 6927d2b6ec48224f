"""Live decoding into the widgets: a synchronous run, an asyncio task that yields between tokens, and
the fused toggle and 'record internals' acting between tokens in both.

Every token is decoded on the thread that made the LiveDecode (mainthread.Owner): a click that arrives on
a kernel subshell thread while a decode runs only sets the switch or the recording flag, which the next
token reads, and queues its chart mark; one that arrives while nothing decodes queues the few tokens that
show the new path on the decoding thread. A point's rate is 1 / the time since the token before it
(the whole loop a user waits on: step, views and chart), so arms are compared as they are lived.

`run(n)` decodes n tokens in the calling cell (what CI executes); `start(n, seconds)` returns an asyncio
task that gives the notebook's event loop a turn after every token and ends after n tokens, after `seconds`,
or, with neither, when stop is pressed (what the **decode live** button starts with its token box at 0, so
a person has all the time needed to click). Await the task before reading its result.
"""

from __future__ import annotations

import asyncio
import html
import math
import time
from collections import deque
from collections.abc import Callable

import ipywidgets as widgets

from ..errors import DecodeError
from .controls import model_name
from .mainthread import Owner
from .static import live_mark, show
from .text import error_html
from .toggle import FusedToggle
from .tps import TokensPerSecondChart

AFTER_TOGGLE_TOKENS = 8
TEXT_TAIL = 400


def instrumented(record) -> bool:
    """Whether internals were recorded for this token (an unrecorded step has no layer records)."""
    return bool(record.layers)


class LiveDecode:
    """Decode with a record.Stepper and feed every token to the chart, the toggle, the text and any `views`."""

    def __init__(self, stepper, chart: TokensPerSecondChart | None = None, toggle: FusedToggle | None = None,
                 views: list[Callable[[object], None]] = ()):
        self.owner = Owner(on_error=self._failed)
        self.chart = chart or TokensPerSecondChart()
        self.toggle = toggle or FusedToggle()  # every model: the picker may open another
        self.toggle.on_change(self._toggled)
        self.views = list(views)
        self.decoded = 0
        self.running = False
        self._marks: deque[str] = deque()  # queued by callbacks on any thread, drawn by the decoding thread
        self._last_end: float | None = None
        self.record_box = widgets.Checkbox(value=stepper.record, description="record internals (slower)",
                                           indent=False)
        self.record_box.add_class("moebench-record-toggle")
        self.record_box.observe(self._record_changed, names="value")
        self.text = widgets.HTML()
        self.text.add_class("moebench-live-text")
        self.status = widgets.HTML()
        self.status.add_class("moebench-live-status")
        self.count = widgets.BoundedIntText(value=0, min=0, max=1_000_000, description="tokens",
                                            layout=widgets.Layout(width="170px"))
        self.count.add_class("moebench-live-count")
        count_hint = widgets.Label("(0: until you press stop)")
        self.button = widgets.Button(description="decode live", icon="play", button_style="primary")
        self.button.add_class("moebench-live-run")
        self.button.on_click(lambda _: self.owner.submit(lambda: self.start(self.count.value or None)))
        self.stop_button = widgets.Button(description="stop", icon="stop")
        self.stop_button.add_class("moebench-live-stop")
        self.stop_button.on_click(lambda _: self.stop())
        self._stopping = False
        self._stepper = None
        self._pending: tuple | None = None  # (stepper, tokens) of a restart asked for during a decode
        self.task: asyncio.Task | None = None
        self.widget = widgets.VBox([self.toggle.widget, widgets.HBox([self.record_box, self.count, count_hint,
                                                                      self.button, self.stop_button]),
                                    self.chart.figure, self.text, self.status, live_mark()])
        self.restart(stepper)

    def restart(self, stepper, tokens: int = 0) -> None:
        """Decode from another Stepper (a new prompt, or another model: then the chart starts empty) with recording
        as ticked, and decode `tokens` tokens of it at once. A running decode is stopped after its current token and
        the restart waits for its end."""
        if self.running:
            self._pending = (stepper, tokens)
            self.stop()
            return
        another = self._stepper is not None and stepper.model is not self._stepper.model
        stepper.record = self.record_box.value
        self._stepper = stepper
        if not stepper.prefilled:
            stepper.prefill()
        if another:
            self.chart.clear()
            self.toggle.forget(f"no token decoded yet on {model_name(stepper.model)}")
        self._show_text()
        if tokens:
            self.run(tokens)

    @property
    def stepper(self):
        """The Stepper decoding now (`restart` replaces it)."""
        return self._stepper

    # -- decoding (always on the owner thread) ---------------------------------------------------------
    def _one(self) -> object:
        self._draw_marks()
        record = self.stepper.step()
        now = time.perf_counter()
        seconds = record.seconds if self._last_end is None else now - self._last_end
        self._last_end = now
        self.decoded += 1
        self.chart.add(record.position, seconds, instrumented(record), record.fused_switch)
        self.toggle.show(record)
        for view in self.views:
            view(record)
        return record

    def _begin(self) -> None:
        if not self.owner.here():
            raise RuntimeError("decode from the thread that made this LiveDecode (its MLX streams live there)")
        if self.running:
            raise RuntimeError("a live decode is already running: await its task (or wait) first")
        self.running, self._stopping = True, False
        self._last_end = None
        self.status.value = "<i>decoding...</i>"

    def _end(self) -> None:
        self.running = False
        self._draw_marks()
        self.chart.flush()
        self._show_text()
        ended = (" The decode has reached its end (a stop token, its token limit or the model's context): decode "
                 "the prompt again to go on." if self.stepper.done else "")
        self.status.value = (f"{self.decoded} tokens decoded; over the chart's window: "
                             + "; ".join(map(html.escape, self.chart.summaries())) + ended)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.restart(*pending)

    def run(self, n: int) -> list:
        """Decode n tokens now (synchronously); returns their records."""
        self._begin()
        try:
            return [self._one() for _ in range(n) if not (self.stepper.done or self._stopping)]
        finally:
            self._end()

    def start(self, n: int | None = None, seconds: float | None = None) -> asyncio.Task:
        """Decode as an asyncio task that yields to the event loop between tokens, until n tokens are decoded,
        `seconds` have passed or stop is pressed (whichever comes first; with neither limit, until stop)."""
        for name, value in (("n", n), ("seconds", seconds)):
            if value is not None and not value > 0:
                raise DecodeError(f"LiveDecode.start: {name} must be positive or None, got {value!r}")
        self._begin()

        async def loop() -> list:
            records = []
            deadline = time.perf_counter() + seconds if seconds is not None else math.inf
            try:
                while n is None or len(records) < n:
                    if self.stepper.done or self._stopping or time.perf_counter() >= deadline:
                        break
                    records.append(self._one())
                    if len(records) % 8 == 0:
                        self._show_text()
                    await asyncio.sleep(0)
            finally:
                self._end()
            return records

        self.task = asyncio.ensure_future(loop())
        return self.task

    # -- callbacks (any thread) ------------------------------------------------------------------------
    def stop(self) -> None:
        """End the running decode after its current token (one assignment: safe from any thread)."""
        self._stopping = True

    def _toggled(self, enabled: bool) -> None:
        self._marks.append("fused ON" if enabled else "fused OFF")
        if not self.running:
            self.owner.submit(self._after_toggle)

    def _after_toggle(self) -> None:
        if not self.running and not self.stepper.done:
            self.run(AFTER_TOGGLE_TOKENS)

    def _record_changed(self, change) -> None:
        self.stepper.record = change["new"]  # one assignment: the next step reads it
        self._marks.append("recording ON" if change["new"] else "recording OFF")
        if not self.running:
            self.owner.submit(self._draw_marks_now)

    # -- drawing (owner thread) -------------------------------------------------------------------------
    def _draw_marks(self) -> None:
        while self._marks:
            self.chart.mark(self.stepper.trace.steps[-1].position + 1, self._marks.popleft())

    def _draw_marks_now(self) -> None:
        if not self.running:  # else the decode draws them before its next token
            self._draw_marks()
            self.chart.flush()

    def _show_text(self) -> None:
        """The prompt and the text decoded so far (its last TEXT_TAIL characters once it grows long)."""
        trace = self.stepper.trace
        prompt = self.stepper.tokenizer.decode(trace.prompt_ids) if self.stepper.tokenizer is not None else ""
        text = trace.text if len(trace.text) <= TEXT_TAIL else "\u2026" + trace.text[-TEXT_TAIL:]
        on = html.escape(model_name(self.stepper.model))
        self.text.value = (f"<div style='font-size:13px'><b>text so far</b> on {on} (prompt in grey):<pre "
                           "style='white-space:pre-wrap;margin:2px 0'><span style='color:#888'>"
                           f"{html.escape(prompt)}</span>"
                           f"{html.escape(text)}</pre></div>")

    def _failed(self, error: BaseException) -> None:
        self.status.value = error_html(error)

    def _ipython_display_(self):
        show(self.widget, [self.chart.figure])
