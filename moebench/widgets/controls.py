"""The controls every notebook starts from: which model, which prompt, how many tokens.

ModelPicker lists the checkpoint folders named in MOEBENCH_MODEL (one, or several separated by the
platform's path separator) and the shipped model, and opens the one picked (each once). PromptControls
holds a prompt (plain text, text sent as one chat user turn, or chat messages as a JSON list of
{"role", "content"}), a system message, the number of tokens, and a decode button; it decodes with a
progress bar on the thread the notebook runs on and hands each new recorded Trace to its callbacks.
"""

from __future__ import annotations

import html
import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import ipywidgets as widgets

from ..checkpoint.loader import ENV_MODEL, SHIPPED_MODEL, load
from ..inspect.record import Stepper, Trace, mixer_text
from .mainthread import Owner
from .static import show
from .text import error_html


def model_choices(environ=os.environ) -> list[str]:
    """MOEBENCH_MODEL's folders first (the first is the default), then the shipped model."""
    named = [p for p in environ.get(ENV_MODEL, "").split(os.pathsep) if p.strip()]
    return list(dict.fromkeys([*named, str(SHIPPED_MODEL)]))


def mixing_text(layer_types) -> str:
    """', 3 linear attention + 1 full attention (layer 3)' for a hybrid; '' when every layer mixes tokens alike.
    The layers of the rarer kind are listed (up to 8), so a reader sees where they sit."""
    kinds = list(dict.fromkeys(layer_types))
    if len(kinds) < 2:
        return ""
    counts = {k: list(layer_types).count(k) for k in kinds}
    rare = min(kinds, key=counts.get)
    at = [i for i, k in enumerate(layer_types) if k == rare]
    listed = ", ".join(map(str, at[:8])) + (", ..." if len(at) > 8 else "")
    parts = " + ".join(f"{counts[k]} {mixer_text(k)}" for k in kinds)
    return f", {parts} ({mixer_text(rare)}: layer{'s' if len(at) > 1 else ''} {listed})"


def model_name(model) -> str:
    """The name a notebook shows for a model: its checkpoint folder's name."""
    return Path(model.load_info.source).name


def describe_model(path: str, model) -> str:
    args = model.args
    shared = "yes" if getattr(args, "shared_expert_intermediate_size", 0) else "no"
    return (f"<b>{html.escape(Path(path).name)}</b> ({html.escape(str(path))}): {len(model.layers)} layers"
            f"{html.escape(mixing_text(getattr(args, 'layer_types', ())))}, {args.num_experts} experts, "
            f"top-{args.num_experts_per_tok}, shared expert: {shared}, "
            f"activations {str(model.dtype).replace('mlx.core.', '')}")


class ModelPicker:
    """A dropdown of checkpoint folders; `model`, `tokenizer` are the open one's; `on_change(callback)`."""

    def __init__(self, choices: list[str] | None = None):
        choices = choices or model_choices()
        self._open: dict[str, tuple] = {}
        self._callbacks: list[Callable[[object, object], None]] = []
        self.owner = Owner(on_error=self._failed)
        self.dropdown = widgets.Dropdown(options=choices, value=choices[0], description="model",
                                         layout=widgets.Layout(width="640px"))
        self.dropdown.add_class("moebench-model-picker")
        self.info = widgets.HTML()
        self.widget = widgets.VBox([self.dropdown, self.info])
        self._select(choices[0])
        self.dropdown.observe(lambda change: self.owner.submit(lambda: self._select(change["new"])), names="value")

    def _select(self, path: str) -> None:
        if path not in self._open:
            self.info.value = f"<i>opening {html.escape(path)}...</i>"
            self._open[path] = load(path)
        self.model, self.tokenizer = self._open[path]
        self.info.value = describe_model(path, self.model)
        for callback in self._callbacks:
            callback(self.model, self.tokenizer)

    def on_change(self, callback: Callable[[object, object], None]) -> None:
        """Call `callback(model, tokenizer)` after another model is picked."""
        self._callbacks.append(callback)

    def _failed(self, error: BaseException) -> None:
        self.info.value = error_html(error)

    def _ipython_display_(self):
        show(self.widget)


def parse_prompt(text: str) -> str | list[dict]:
    """Chat messages when the text is a JSON list of {"role", "content"} objects, else the text itself."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError:
            return text
        if isinstance(value, list) and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in value):
            return value
    return text


class PromptControls:
    """Prompt, chat options, token count and a decode button; `trace` is the last decode's Trace and `model` the
    model that decoded it (after another model is picked, the same prompt is decoded on it)."""

    def __init__(self, picker: ModelPicker, prompt: str | list[dict] = "", tokens: int = 12, record: bool = True,
                 decode_now: bool = True, **stepper_options):
        self.picker, self.record, self.options = picker, record, stepper_options
        self.owner = Owner(on_error=self._failed)
        self._callbacks: list[Callable[[Trace], None]] = []
        self.trace: Trace | None = None
        self.model = None
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, indent=1)
        self.prompt = widgets.Textarea(value=text, description="prompt", layout=widgets.Layout(width="640px",
                                       height="80px"), placeholder='text, or [{"role": "user", "content": "..."}]')
        self.prompt.add_class("moebench-prompt")
        self.chat = widgets.Checkbox(value=False, description="send text as a chat user turn", indent=False)
        self.system = widgets.Text(value="", description="system", placeholder="system message (chat only)",
                                   layout=widgets.Layout(width="640px"))
        self.tokens = widgets.BoundedIntText(value=tokens, min=1, max=4096, description="tokens",
                                             layout=widgets.Layout(width="170px"))
        self.tokens.add_class("moebench-tokens")
        self.button = widgets.Button(description="decode", icon="play", button_style="primary")
        self.button.add_class("moebench-decode")
        self.button.on_click(lambda _: self.owner.submit(self.decode))
        self.progress = widgets.IntProgress(value=0, min=0, max=tokens, layout=widgets.Layout(width="300px"))
        self.status = widgets.HTML()
        self.status.add_class("moebench-decode-status")
        self.widget = widgets.VBox([self.prompt, widgets.HBox([self.chat, self.system]),
                                    widgets.HBox([self.tokens, self.button, self.progress]), self.status])
        picker.on_change(lambda *_: self.decode())  # another model: decode the same prompt on it
        if decode_now:
            self.decode()

    def on_decode(self, callback: Callable[[Trace], None]) -> None:
        """Call `callback(trace)` after every decode (and now, for the one already done)."""
        self._callbacks.append(callback)
        if self.trace is not None:
            callback(self.trace)

    def prompt_value(self) -> str | list[dict]:
        return parse_prompt(self.prompt.value)

    def stepper(self, **options) -> Stepper:
        """A Stepper on the picked model with the prompt as set now (chat options included)."""
        prompt = self.prompt_value()
        chat = {"chat": self.chat.value} if isinstance(prompt, str) and self.chat.value else {}
        if (chat or not isinstance(prompt, str)) and self.system.value.strip():
            chat["system"] = self.system.value
        return Stepper(self.picker.model, self.picker.tokenizer, prompt, **{"record": self.record,
                                                                             **self.options, **chat, **options})

    def decode(self) -> Trace:
        """Decode the prompt for the set number of tokens, with the progress bar, then call back."""
        n = self.tokens.value
        self.button.disabled = True
        self.progress.max, self.progress.value, self.progress.bar_style = n, 0, ""
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stepper = self.stepper(max_tokens=n)
            stepper.prefill()
            self.progress.value = 1
            while not stepper.done:
                stepper.step()
                self.progress.value += 1
        finally:
            self.button.disabled = False
        self.trace, self.model = stepper.trace, stepper.model
        self.progress.bar_style = "success"
        notes = "".join(f"<br><i>{html.escape(str(w.message))}</i>" for w in caught)
        self.status.value = (f"{len(self.trace.prompt_ids)} prompt tokens, {len(self.trace.generated)} generated in "
                             f"{time.perf_counter() - start:.2f} s: <code>{html.escape(self.trace.text)}</code>{notes}")
        for callback in self._callbacks:
            callback(self.trace)
        return self.trace

    def _failed(self, error: BaseException) -> None:
        self.progress.bar_style = "danger"
        self.status.value = error_html(error)

    def _ipython_display_(self):
        show(self.widget)


def on_all_decoded(controls: list[PromptControls], callback: Callable[[], None]) -> None:
    """Call `callback()` after a decode of any of `controls`, once every one of them holds a decode by the picked
    model (and now, if they do). Picking another model decodes them one after the other: a view that compares
    their traces waits for the last, instead of comparing the new model with the old."""
    def decoded(_trace) -> None:
        if all(c.model is not None and c.model is c.picker.model for c in controls):
            callback()

    for c in controls:
        c._callbacks.append(decoded)
    decoded(None)
