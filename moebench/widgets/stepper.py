"""Token stepper: play / previous / next / slider over precomputed step records.

Scrubbing stays smooth while the kernel is busy: the play widget, the slider and the token strip are
linked in the browser (jslink), and the strip renders every token and its candidates from data sent
once. Python views (router, experts, ...) follow the slider through `on_step` when the kernel is free.
"""

from __future__ import annotations

from collections.abc import Callable

import anywidget
import ipywidgets as widgets
import traitlets

from ..inspect.record import Trace
from .static import show
from .text import visible
from .toggle import describe_paths

STRIP_ESM = """
function render({ model, el }) {
  el.classList.add("moebench-token-strip");
  const strip = document.createElement("div");
  strip.style.cssText = "font-family: monospace; line-height: 1.9; margin: 4px 0; white-space: normal;";
  const detail = document.createElement("div");
  detail.style.cssText = "font-family: sans-serif; font-size: 13px; min-height: 3.2em;";
  const legend = document.createElement("div");
  legend.style.cssText = "font-family: sans-serif; font-size: 11px; color: #666;";
  legend.textContent = "token glyphs: \u00b7 = a space, \u23ce = a newline, \u21e5 = a tab (the token's own " +
    "characters otherwise); grey tokens: the prompt before the first stepped token; click a token to select it";
  el.append(legend, strip, detail);
  function draw() {
    const before = model.get("before");
    const steps = model.get("steps");
    const index = model.get("index");
    strip.replaceChildren();
    for (const text of before) {
      const span = document.createElement("span");
      span.textContent = text;
      span.style.cssText = "display: inline-block; color: #999; padding: 1px 2px;";
      strip.append(span);
    }
    steps.forEach((step, i) => {
      const span = document.createElement("span");
      span.textContent = step.input;
      span.title = "step " + i + " (click to select)";
      const current = i === index;
      span.style.cssText = "display: inline-block; padding: 0 2px; margin: 1px; border-radius: 3px; cursor: pointer;" +
        (current ? "background: #ffd54f; outline: 2px solid #f57f17;" : "background: #e3f2fd;");
      span.addEventListener("click", () => { model.set("index", i); model.save_changes(); });
      strip.append(span);
    });
    detail.replaceChildren();
    if (!steps.length) { detail.textContent = "no tokens recorded yet"; return; }
    const step = steps[Math.min(index, steps.length - 1)];
    const head = document.createElement("div");
    const b = (t) => { const e = document.createElement("b"); e.textContent = t; return e; };
    head.append(b("step " + index + ": "), "reading ", b("'" + step.input + "'"));
    if (step.chosen !== null) head.append(", the model chose ", b("'" + step.chosen + "'"));
    const cand = document.createElement("div");
    cand.textContent = "top next-token candidates: " +
      step.candidates.map(c => "'" + c[0] + "' " + (100 * c[1]).toFixed(1) + "%").join(",  ");
    const path = document.createElement("div");
    path.style.color = "#555";
    path.textContent = "MoE path: " + step.path;
    detail.append(head, cand, path);
    if (step.note) {
      const note = document.createElement("div");
      note.style.cssText = "color: #555; font-style: italic;";
      note.textContent = step.note;
      detail.append(note);
    }
  }
  model.on("change:index", draw);
  model.on("change:steps", draw);
  model.on("change:before", draw);
  draw();
}
export default { render };
"""


class TokenStrip(anywidget.AnyWidget):
    """The tokens read at each step, the current one highlighted with its top candidates (browser-side)."""

    _esm = STRIP_ESM
    before = traitlets.List(traitlets.Unicode()).tag(sync=True)
    steps = traitlets.List(traitlets.Dict()).tag(sync=True)
    index = traitlets.Int(0).tag(sync=True)


PREFILL_NOTE = ("This position belongs to the prompt, which runs in one forward call for all its tokens "
                "(prefill). The fused kernels are written for one decode token, so prefill takes the fallback "
                "(gather_qmm over every prompt token at once) and MLX's attention; decode tokens take the kernels.")


def strip_entry(record) -> dict:
    """What the strip needs from one step record: the token read, the token chosen, candidates, the path."""
    return {
        "input": visible(record.input_text),
        "chosen": None if record.token_id is None else visible(record.token_text),
        "candidates": [[visible(c.text), c.prob] for c in record.candidates],
        "path": describe_paths(record),
        "note": PREFILL_NOTE if record.phase == "prefill" else "",
    }


class TokenStepper:
    """Step through records: `TokenStepper(trace, on_step=view.show)` or `TokenStepper(trace.prefill)`.

    Given a record.Trace, the steps are its generated tokens (the last prompt position, then each decode
    step) after the rest of the prompt; given a list, exactly those records. Each step shows the token
    being read, whose internals the views display, and the token the model chose after it.
    """

    def __init__(self, records, on_step: Callable[[object], None] | None = None, interval_ms: int = 600):
        self.records: list = []
        self._callbacks: list[Callable[[object], None]] = []
        self.strip = TokenStrip()
        self.play = widgets.Play(value=0, min=0, max=0, step=1, interval=interval_ms, description="play")
        self.slider = widgets.IntSlider(value=0, min=0, max=0, description="step", continuous_update=True,
                                        layout=widgets.Layout(width="420px"))
        self.prev = widgets.Button(description="previous", icon="step-backward", layout=widgets.Layout(width="110px"))
        self.next = widgets.Button(description="next", icon="step-forward", layout=widgets.Layout(width="110px"))
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        widgets.jslink((self.slider, "value"), (self.strip, "index"))
        self.prev.on_click(lambda _: self.go(self.index - 1))
        self.next.on_click(lambda _: self.go(self.index + 1))
        self.slider.observe(self._moved, names="value")
        self.widget = widgets.VBox([widgets.HBox([self.play, self.prev, self.next, self.slider]), self.strip])
        self.widget.add_class("moebench-stepper")
        if on_step is not None:
            self.on_step(on_step)
        self.reset(records)

    def reset(self, records) -> None:
        """Step through other records (a new decode): back to the first step, views redrawn."""
        before = []
        if isinstance(records, Trace):
            before = [visible(s.input_text) for s in records.prefill[:-1]]
            records = records.generated
        self.records = []
        with self.strip.hold_sync():
            self.strip.before, self.strip.steps, self.strip.index = before, [], 0
        self.play.value = self.slider.value = 0
        self.extend(records)

    @property
    def index(self) -> int:
        return self.slider.value

    @property
    def current(self):
        return self.records[self.index] if self.records else None

    def on_step(self, callback: Callable[[object], None]) -> None:
        """Call `callback(record)` whenever the current step changes (and now, if there is one)."""
        self._callbacks.append(callback)
        if self.records:
            callback(self.current)

    def append(self, record) -> None:
        """Add a newly decoded step (live decoding) without moving the current position."""
        self.extend([record])

    def extend(self, records) -> None:
        """Add steps in one update of the browser-side strip."""
        records = list(records)
        if not records:
            return
        first = not self.records
        self.records += records
        self.strip.steps = [*self.strip.steps, *map(strip_entry, records)]
        self.play.max = self.slider.max = len(self.records) - 1
        if first:
            self._notify()

    def go(self, index: int) -> None:
        """Move to a step (clamped to the recorded range)."""
        self.slider.value = max(0, min(index, len(self.records) - 1))

    def _moved(self, change) -> None:
        self._notify()

    def _notify(self) -> None:
        if not self.records:
            return
        for callback in self._callbacks:
            callback(self.current)

    def _ipython_display_(self):
        show(self.widget)
