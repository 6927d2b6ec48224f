"""The fused-kernel toggle: flips moebench's runtime switch between tokens and says which path ran.

The button only sets the switch; what the label reports comes from the latest step record, so it says
what the model actually did (a backend name, or 'fallback' with the decline reason), and until the next
token is decoded it also says that the switch was flipped and applies from that token. Clicks may come on
a kernel subshell thread: the button only sets the switch (one assignment) and calls back; decoding is the
callbacks' business (see mainthread.Owner).
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Callable

import ipywidgets as widgets

from ..execution.executor import fused_moe_enabled, set_fused_moe
from .static import show


def describe_paths(record) -> str:
    """'fused reference kernel on 4 of 4 MoE layers' or 'fallback (gather_qmm) on 4 of 4 MoE layers: <reason>',
    then the attention of those layers: '; attention: the reference decode-attention kernel on 4 of 4'."""
    paths = Counter((layer.path.path, layer.path.reason or layer.path.note) for layer in record.layers.values())
    total = sum(paths.values())
    if not total:
        return "not recorded (internals were off for this token)"
    parts = []
    for (path, why), n in paths.most_common():
        name = "fallback (gather_qmm)" if path == "fallback" else f"fused {path} kernel"
        parts.append(f"{name} on {n} of {total} MoE layers" + (f": {why}" if why else ""))
    attention = Counter((d.path, d.reason) for layer in record.layers.values()
                        if (d := getattr(layer, "attn_path", None)) is not None)
    for (path, why), n in attention.most_common():
        name = "MLX ops" if path == "fallback" else f"the {path} decode-attention kernel"
        parts.append(f"attention: {name} on {n} of {total}" + (f": {why}" if why else ""))
    return "; ".join(parts)


class FusedToggle:
    """A toggle button bound to moebench.set_fused_moe (for `model`, or every model), and a label with the
    path of the last step."""

    def __init__(self, on_change: Callable[[bool], None] | None = None, model=None):
        self._callbacks: list[Callable[[bool], None]] = [on_change] if on_change is not None else []
        self.model = model
        self._last = ""
        self.button = widgets.ToggleButton(
            value=fused_moe_enabled(model), description="",
            tooltip="switch the fused decode-MoE kernel on or off before the next token",
            layout=widgets.Layout(width="190px", flex="0 0 auto"),
        )
        self.button.add_class("moebench-fused-toggle")
        self.label = widgets.HTML("<i>no token decoded yet</i>")
        self.label.add_class("moebench-backend-label")
        self._describe_button()
        self.button.observe(self._flip, names="value")
        self.widget = widgets.HBox([self.button, self.label])

    @property
    def enabled(self) -> bool:
        return self.button.value

    def on_change(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(enabled)` after every flip (the switch is already set)."""
        self._callbacks.append(callback)

    def set(self, enabled: bool) -> None:
        """Same as clicking: the switch changes before the next token."""
        self.button.value = bool(enabled)

    def forget(self, why: str) -> None:
        """No token decoded yet on what is decoded now (another model): the label says `why` instead of a path."""
        self._last = ""
        self.label.value = f"<i>{html.escape(why)}</i>"

    def show(self, record) -> None:
        """Report the path a decoded step took (known only when its internals were recorded)."""
        switch = "on" if record.fused_switch else "off"
        if record.layers:
            self._last = (f"switch {switch}; last token (position {record.position}) ran: "
                          f"<b>{describe_paths(record)}</b>")
        else:
            self._last = (f"switch {switch}; last token (position {record.position}): path not recorded "
                          "(turn on recording to see which kernel ran)")
        self.label.value = self._last

    def _describe_button(self) -> None:
        on = self.button.value
        self.button.description = "fused kernel: ON" if on else "fused kernel: OFF"
        self.button.icon = "toggle-on" if on else "toggle-off"
        self.button.button_style = "success" if on else "warning"

    def _flip(self, change) -> None:
        set_fused_moe(change["new"], self.model)
        self._describe_button()
        pending = f"switch set {'on' if change['new'] else 'off'}: applies from the next token"
        self.label.value = f"{pending}; {self._last}" if self._last else pending
        for callback in self._callbacks:
            callback(change["new"])

    def _ipython_display_(self):
        show(self.widget)
