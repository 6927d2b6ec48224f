"""Routing drift: where a quantization or the fused kernel changes which experts run (moebench.inspect.drift).

DriftControls makes the variants of the picked model (mlx-lm's recipes of its folder through
moebench.tools.drift.make_variant, or the model itself with its fused switch set), feeds them all the same held-out
code, prose or typed text, and hands the Drift to its callbacks. DriftView draws one Drift and reads nothing else:
per MoE layer and token, the kind of change against the reference (the kinds, their colours and the legend's words
all come from KINDS, so the legend cannot contradict the map), the next-token KL under it, the per-layer table and
the worst tokens in context. A click on a cell shows both routings there and what the change did to the next-token
prediction.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ipywidgets as widgets
import numpy as np
import pandas as pd
from plotly.subplots import make_subplots

from ..errors import MoebenchError
from ..inspect.drift import Drift, Variant, as_variant, drift
from ..tools.corpus import DEFAULT_CACHE, DOMAINS
from ..tools.drift import SUFFIXES, held_out, is_recipe, make_variant, recipe_name, tokenizer_cut, windows
from .controls import model_name
from .figure import LiveFigure, go
from .mainthread import Owner
from .quiet import captured
from .stale import StaleNote
from .static import live_mark, show
from .text import error_html, shown, visible


@dataclass(frozen=True)
class Kind:
    label: str  # may name the near-tie bound: {margin}
    colour: str


KINDS = (Kind("same experts", "#eeeeee"),
         Kind("near-tie (router margin < {margin:g})", "#f6b26b"),
         Kind("top-k set changed, top-1 kept", "#3d85c6"),
         Kind("top-1 flip", "#b71c1c"))
SAME, NEAR_TIE, SET_CHANGE, TOP1_FLIP = range(len(KINDS))
NEXT_CHANGED, NEXT_SAME = "#b71c1c", "#9e9e9e"  # the next-token bars: likeliest token changed or not
TABLE_CSS = ("<style>.moebench-drift-view table { border-collapse: collapse; font-size: 12px; margin: 4px 0 }"
             " .moebench-drift-view th, .moebench-drift-view td { padding: 1px 8px; border-bottom: 1px solid #ddd;"
             " text-align: right; white-space: pre } .moebench-drift-view th { white-space: normal }"
             " .moebench-drift-worst td:last-child { text-align: left }"
             " .moebench-drift-tables { display: flex; flex-wrap: wrap; gap: 8px 32px }</style>")


def kinds(frame: pd.DataFrame) -> np.ndarray:
    """Each row's kind of change (an index into KINDS): a real top-1 flip, else a real change of the top-k set,
    else a near-tie, else the same experts."""
    real, top1, tie = (frame[c].to_numpy(bool) for c in ("real", "top1_flip", "near_tie"))
    return np.select([real & top1, real, tie], [TOP1_FLIP, SET_CHANGE, NEAR_TIE], SAME)


def labels(tie_margin: float) -> list[str]:
    return [k.label.format(margin=tie_margin) for k in KINDS]


def colorscale() -> list[list]:
    """Kind i fills [i/n, (i+1)/n] of the scale: with zmin -0.5 and zmax n-0.5, z = i takes exactly its colour."""
    n = len(KINDS)
    return [[edge / n, kind.colour] for i, kind in enumerate(KINDS) for edge in (i, i + 1)]


def colorbar(tie_margin: float) -> dict:
    return {"title": {"text": "routing"}, "tickvals": list(range(len(KINDS))), "ticktext": labels(tie_margin),
            "len": 0.62, "y": 1.0, "yanchor": "top", "tickfont": {"size": 11}}


# Column names of Drift's frames, in words
HEADERS = {"jaccard": "mean Jaccard", "top1_flips": "top-1 flips", "set_changes": "set changed", "near_ties":
           "near-ties", "real": "real changes", "router_kl": "router KL", "moved": "moved", "changed": "set changed",
           "logits_kl": "next-token KL", "next_top1_change": "next token changed",
           "bias_changes": "bias-made changed"}


def html_table(frame: pd.DataFrame, index: bool = False) -> str:
    """`frame` as an HTML table, its columns named in words."""
    return frame.rename(columns=HEADERS).to_html(index=index, float_format=lambda x: f"{x:.3g}", na_rep="-",
                                                 border=0)


HINT = "<i>click a cell of the map for both routings there and the next-token change</i>"


class DriftView:
    """`view.show(result)` draws a Drift; `variant` picks the compared variant shown; `select(index, layer)` (or a
    click on the map) shows one cell, kept in `picked` as (token index, layer); `grid` holds the kinds drawn."""

    def __init__(self, width: int = 980):
        self.result: Drift | None = None
        self.by_token: pd.DataFrame | None = None
        self.grid: np.ndarray | None = None  # [layers, tokens] kinds of the variant shown
        self.picked: tuple[int, int] | None = None
        self.variant = widgets.ToggleButtons(description="variant", style={"button_width": "auto"})
        self.variant.add_class("moebench-drift-variant")
        self.variant.observe(self._draw, names="value")
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3], vertical_spacing=0.1,
                            subplot_titles=("routing change per MoE layer and token (click a cell)",
                                            "next-token KL(reference || variant), nats"))
        fig.add_trace(go.Heatmap(z=[[0]], zmin=-0.5, zmax=len(KINDS) - 0.5, colorscale=colorscale(),
                                 colorbar=colorbar(0.0), xgap=0, ygap=1,
                                 hovertemplate="token %{x} %{customdata[0]}<br>layer %{y}: %{customdata[1]}"
                                               "%{customdata[2]}<extra></extra>"), row=1, col=1)
        for name, colour in (("likeliest next token changed", NEXT_CHANGED),
                             ("same likeliest next token", NEXT_SAME)):
            fig.add_trace(go.Bar(x=[], y=[], name=name, marker={"color": colour, "line": {"width": 0}},
                                 hovertemplate="token %{x}<br>next-token KL %{y:.3g}<extra>" + name + "</extra>"),
                          row=2, col=1)
        fig.update_yaxes(title_text="MoE layer", autorange="reversed", type="category", row=1, col=1)
        fig.update_yaxes(title_text="KL (nats)", rangemode="tozero", row=2, col=1)
        fig.update_xaxes(title_text="token (index into the fed text; dotted lines: a new sequence)", row=2, col=1)
        fig.update_layout(width=width, barmode="overlay", bargap=0, title={"x": 0}, modebar={"orientation": "v"},
                          margin={"l": 70, "r": 260, "t": 90, "b": 60},
                          legend={"x": 1.02, "y": 0.0, "yanchor": "bottom", "font": {"size": 11}})
        self.figure = LiveFigure(fig)
        self.figure.data[0].on_click(self._clicked)
        self.summary = widgets.HTML()
        self.readout = widgets.HTML(HINT)
        self.readout.add_class("moebench-drift-readout")
        self.tables = widgets.HTML()
        style = widgets.HTML(TABLE_CSS, layout=widgets.Layout(display="none"))
        self.note = StaleNote("the map, its tables and the cells below compare variants of", "compare")
        self.widget = widgets.VBox([self.note.widget, self.variant, self.summary, self.figure, self.readout,
                                    self.tables, style, live_mark()])
        self.widget.add_class("moebench-drift-view")

    def stale(self, shown: str, picked: str, rerun: Callable[[], None]) -> None:
        """Another model is picked (DriftControls.on_stale): the map is `shown`'s; the note's button runs `rerun`."""
        self.note.rerun = rerun
        self.note.show(shown, picked)

    def show(self, result: Drift) -> None:
        """Draw `result`, keeping the variant shown when the new result has it, else the one that drifts most."""
        self.result, self.by_token, self.picked = result, result.by_token(), None
        self.note.hide()
        self.readout.value = HINT
        names, keep = result.names[1:], self.variant.value
        f = result.frame()
        most = (f["set_change"] | f["top1_flip"]).groupby(f["variant"], sort=False).sum().idxmax()
        self.variant.unobserve(self._draw, names="value")
        self.variant.options = names
        self.variant.value = keep if keep in names else most
        self.variant.observe(self._draw, names="value")
        self._draw()

    def frames(self) -> dict[str, pd.DataFrame]:
        """The shown result's frames, every variant: what the export bar writes."""
        if self.result is None:
            raise MoebenchError("no drift to export yet: press compare")
        d = self.result
        return {"drift": d.frame(), "by_layer": d.by_layer(), "by_token": self.by_token, "by_expert": d.by_expert()}

    def _rows(self, table: pd.DataFrame) -> pd.DataFrame:
        return table[table["variant"] == self.variant.value].drop(columns="variant")

    def _draw(self, _change=None) -> None:
        d, v = self.result, self.variant.value
        f = self._rows(d.frame())
        t, n_layers = len(d.tokens), len(d.layers)
        # Drift.frame's rows run token by token, every MoE layer within a token
        self.grid = kinds(f).reshape(t, n_layers).T
        margin = f["margin"].to_numpy(float).reshape(t, n_layers).T
        names = labels(d.tie_margin)
        tokens = self._rows(self.by_token)
        texts = [html.escape(shown(x)) for x in tokens["text"]]
        custom = [[[texts[i], names[k], "" if np.isnan(m) else f"<br>margin {m:.2g}"]
                   for i, (k, m) in enumerate(zip(row, mrow, strict=True))]
                  for row, mrow in zip(self.grid, margin, strict=True)]
        kl = pd.to_numeric(tokens["logits_kl"], errors="coerce").to_numpy(float)
        changed = tokens["next_top1_change"].eq(True).to_numpy()  # NA (no logits): not changed
        starts = np.flatnonzero(np.diff(d.seq)) + 1
        with self.figure.batch_update():
            heat, moved, kept = self.figure.data
            heat.z, heat.x, heat.y, heat.customdata = self.grid, list(range(t)), [f"L{i}" for i in d.layers], custom
            heat.colorbar.update(colorbar(d.tie_margin))
            xs = np.arange(t)
            moved.x, moved.y = xs[changed], kl[changed]
            kept.x, kept.y = xs[~changed], kl[~changed]
            self.figure.layout.shapes = [{"type": "line", "xref": "x", "yref": "paper", "x0": s - 0.5, "x1": s - 0.5,
                                          "y0": 0, "y1": 1, "line": {"color": "#555", "width": 1, "dash": "dot"}}
                                         for s in starts]
            self.figure.layout.annotations[1].text = ("next-token KL(reference || variant), nats" if
                                                      np.isfinite(kl).any() else
                                                      "no next-token KL: a routing file has no logits")
            self.figure.layout.title.text = (f"routing drift of {v} against {d.reference}: {t} tokens, "
                                             f"{n_layers} MoE layers")
            self.figure.layout.height = 330 + 26 * n_layers
        counts = np.bincount(self.grid.ravel(), minlength=len(KINDS))
        self.summary.value = (f"<b>{html.escape(v)}</b> against <b>{html.escape(d.reference)}</b>, {t * n_layers} "
                              "token-layers: " + ", ".join(f"<span style='color:{k.colour if i else '#555'}'>"
                                                           f"{html.escape(name)}</span> {c}" for i, (k, name, c) in
                                                           enumerate(zip(KINDS, names, counts, strict=True)))
                              + f"; likeliest next token changed at {int(changed.sum())} of {t} tokens")
        worst = self._rows(d.worst(10, variant=v)).assign(context=lambda w: w["context"].map(visible))
        worst = worst.loc[worst["real"] + worst["near_ties"] > 0,  # a change in some layer
                          ["index", "real", "near_ties", "changed", "top1_flips", "logits_kl", "next_top1_change",
                           "context"]]
        listed = html_table(worst) if len(worst) else "<br><i>none: no token changed its experts</i>"
        self.tables.value = ("<div class='moebench-drift-tables'><div><b>per MoE layer</b>"
                             f"{html_table(self._rows(d.by_layer()))}</div><div class='moebench-drift-worst'>"
                             f"<b>tokens with the most real changes</b> (index: the map's column){listed}</div></div>")
        if self.picked is not None:
            self.select(*self.picked)

    def select(self, index: int, layer: int | None = None) -> None:
        """Show both routings at token `index` and `layer` (None: the layer of its most severe change) and the
        next-token change there: what a click on the map does."""
        d, v = self.result, self.variant.value
        if d is None:
            raise MoebenchError("no drift shown yet: press compare")
        if not 0 <= index < len(d.tokens):
            raise MoebenchError(f"index must be in 0..{len(d.tokens) - 1}, got {index!r}")
        layer = d.layers[int(np.argmax(self.grid[:, index]))] if layer is None else layer
        cell = d.cell(v, index, layer)
        self.picked = (index, layer)
        f = self._rows(d.frame())
        at = f.iloc[index * len(d.layers) + d.layers.index(layer)]
        routed = pd.concat([cell[cell["arm"] == arm].set_index("rank")[["expert", "score", "prob"]]
                            for arm in (d.reference, v)], axis=1, keys=[d.reference, v])
        routed.index = [f"#{r + 1}" for r in routed.index]  # as the router view ranks them
        parts = [f"<div><b>routing at layer {layer}</b>{html_table(routed, index=True)}</div>"]
        token = self._rows(self.by_token).iloc[index]
        if pd.notna(token["logits_kl"]):
            nxt = d.next_tokens(v, index)
            nxt = nxt.assign(text=nxt["text"].map(visible), change=nxt[v] - nxt[d.reference])
            parts.append(f"<div><b>next token</b> (KL {float(token['logits_kl']):.3g} nats; likeliest "
                         f"{'changed' if token['next_top1_change'] else 'the same'}){html_table(nxt)}</div>")
        detail = "" if np.isnan(at["margin"]) else f", margin {at['margin']:.3g}"
        self.readout.value = (f"<b>token {index} {html.escape(shown(token['text']))} (sequence {int(token['seq'])}, "
                              f"position {int(token['pos'])}), layer {layer}</b>: "
                              f"{html.escape(labels(d.tie_margin)[self.grid[d.layers.index(layer), index]])}, "
                              f"Jaccard {at['jaccard']:.3g}{detail}<br>context: <code>"
                              f"{html.escape(visible(d.context(index)))}</code>"
                              f"<div class='moebench-drift-tables'>{''.join(parts)}</div>")

    def _clicked(self, _trace, points, _state) -> None:
        if points.xs and self.result is not None:
            self.select(int(round(float(points.xs[0]))), int(str(points.ys[0]).removeprefix("L")))

    def _ipython_display_(self):
        show(self.widget, [self.figure])


SOURCES = (("held-out code", "code"), ("held-out prose", "prose"), ("typed text", "text"))


class DriftControls:
    """Variants to compare with the picked model (each a recipe name, or 'fused' / 'fallback': the model with its
    fused switch set, fed token by token), the text to feed, a compare button; `result` is the last Drift."""

    def __init__(self, picker, variants: list[str], chosen: list[str] | None = None, source: str = "code",
                 text: str = "", tokens: int = 256, window: int = 256,
                 variants_dir: str | Path = DEFAULT_CACHE / "variants", run_now: bool = True):
        bad = [v for v in variants if not isinstance(v, str) or not (is_recipe(v) or v in SUFFIXES)]
        if isinstance(variants, str) or not variants or bad:
            raise MoebenchError(f"variants: a list of recipe names (8bit, 4bit, mxfp4, float, ...) or "
                                f"{list(SUFFIXES)}, got {bad or variants!r}")
        if not isinstance(tokens, int) or tokens < 1:
            raise MoebenchError(f"tokens must be a whole number >= 1, got {tokens!r}")
        chosen = list(variants[:1] if chosen is None else chosen)
        if not set(chosen) <= set(variants):
            raise MoebenchError(f"chosen must be among the variants {variants}, got {chosen}")
        if source not in dict(SOURCES).values():
            raise MoebenchError(f"source must be one of {[s for _, s in SOURCES]}, got {source!r}")
        self.picker, self.window, self.variants_dir = picker, window, Path(variants_dir)
        self.owner = Owner(on_error=self._failed)
        self.result: Drift | None = None
        self._callbacks: list[Callable[[Drift], None]] = []
        self._loaded: dict[Path, Variant] = {}
        self.log: list[str] = []  # what the libraries making the variants printed or logged, last comparison
        self.boxes = {v: widgets.Checkbox(value=v in chosen, description=v, indent=False,
                                          layout=widgets.Layout(width="auto")) for v in variants}
        self.source = widgets.ToggleButtons(options=SOURCES, value=source, description="feed",
                                            style={"button_width": "auto"})
        self.text = widgets.Textarea(value=text, placeholder="text to feed (with 'typed text')",
                                     layout=widgets.Layout(width="640px", height="60px"))
        self.tokens = widgets.BoundedIntText(value=tokens, min=1, max=100_000, description="tokens",
                                             layout=widgets.Layout(width="170px"))
        self.button = widgets.Button(description="compare", icon="play", button_style="primary")
        self.button.add_class("moebench-drift-run")
        self.button.on_click(lambda _: self.owner.submit(self.run))
        self.progress = widgets.IntProgress(value=0, min=0, max=1, layout=widgets.Layout(width="300px"))
        self.status = widgets.HTML()
        self.status.add_class("moebench-drift-status")
        boxes = widgets.HBox([widgets.Label("variants", layout=widgets.Layout(width="80px")), *self.boxes.values()])
        boxes.add_class("moebench-drift-variants")
        self.widget = widgets.VBox([boxes, self.source, self.text,
                                    widgets.HBox([self.tokens, self.button, self.progress]), self.status])
        self._stale: list[Callable[[str, str, Callable[[], None]], None]] = []
        self.model = None  # the model `result` compared its variants with
        picker.on_change(lambda *_: self._picked())
        if run_now:
            self.run()

    def on_result(self, callback: Callable[[Drift], None]) -> None:
        """Call `callback(result)` after every comparison (and now, for the one already done)."""
        self._callbacks.append(callback)
        if self.result is not None:
            callback(self.result)

    def on_stale(self, callback: Callable[[str, str, Callable[[], None]], None]) -> None:
        """Call `callback(shown, picked, rerun)` when another model is picked while the result shown is the last
        one's (the models' names, and what measures the picked one: making its variants takes a while, so a pick
        does not start it)."""
        self._stale.append(callback)

    def _picked(self) -> None:
        self._note("another model is picked: press <b>compare</b> to measure its variants (the view still shows "
                   "the last result)")
        if self.model is not None and self.model is not self.picker.model:
            for callback in self._stale:
                callback(model_name(self.model), model_name(self.picker.model), lambda: self.owner.submit(self.run))

    def variant(self, folder: Path, name: str) -> Variant:
        """The named variant of the picked model: itself with its fused switch set, or a recipe made from `folder`
        into variants_dir (reused when made before) and loaded once."""
        if name in SUFFIXES:
            return Variant(name, model=self.picker.model, tokenizer=self.picker.tokenizer, fused=SUFFIXES[name])
        try:
            with captured() as lines:  # mlx-lm's progress, transformers' warnings: kept in `log`, not in the cell
                path = make_variant(folder, name, self.variants_dir)
                if path not in self._loaded:
                    self._loaded[path] = as_variant(path, recipe_name(name))
        finally:
            self.log += [f"[{name}] {line}" for line in lines]
        return self._loaded[path]

    def prompts(self, tokenizer) -> list[list[int]]:
        """The token sequences to feed: held-out text cut into windows, or the typed text, `tokens` long at most."""
        if self.source.value in DOMAINS:
            return windows(held_out(tokenizer, self.source.value, self.tokens.value), self.window)
        if not self.text.value.strip():
            raise MoebenchError("text: type a text to feed, or pick held-out code or prose")
        return [tokenizer_cut(tokenizer, self.text.value, self.tokens.value)]

    def run(self) -> Drift:
        """Make or load the ticked variants, feed the text through them and the model, call back with the Drift."""
        names = [v for v, box in self.boxes.items() if box.value]
        if not names:
            raise MoebenchError("variants: tick at least one to compare with the model")
        model, tokenizer = self.picker.model, self.picker.tokenizer
        folder = Path(model.load_info.source)
        start = time.perf_counter()
        self.log = []
        self.button.disabled = True
        self.progress.max, self.progress.value, self.progress.bar_style = len(names) + 1, 0, ""
        try:
            arms = [Variant(folder.name, model=model, tokenizer=tokenizer)]
            for name in names:
                self._note(f"making or loading the {name} variant of {html.escape(folder.name)} (into "
                           f"{html.escape(str(self.variants_dir))})...")
                arms.append(self.variant(folder, name))
                self.progress.value += 1
            prompts = self.prompts(tokenizer)
            n = sum(map(len, prompts))
            stepped = any(a.fused is not None for a in arms)
            self._note(f"feeding {n} tokens through {len(arms)} models"
                       f"{' token by token (a fused switch is set)' if stepped else ''}...")
            result = drift(arms, prompts, tokenizer)
            result.frame()
        finally:
            self.button.disabled = False
        self.progress.value, self.progress.bar_style = self.progress.max, "success"
        self.result, self.model = result, model
        self._note(f"{n} tokens of {dict((v, k) for k, v in SOURCES)[self.source.value]} through "
                   f"{html.escape(folder.name)} and {', '.join(names)} in {time.perf_counter() - start:.1f} s"
                   + self._log_html())
        for callback in self._callbacks:
            callback(result)
        return result

    def _note(self, text: str) -> None:
        """The status line (HTML): what is being done, or what was."""
        self.status.value = text

    def _log_html(self) -> str:
        """The lines the libraries printed or logged while making the variants, folded under the status."""
        if not self.log:
            return ""
        return (f"<details><summary>what mlx-lm and the libraries it calls wrote ({len(self.log)} lines)</summary>"
                f"<pre style='font-size:11px;margin:2px 0'>{html.escape(chr(10).join(self.log))}</pre></details>")

    def _failed(self, error: BaseException) -> None:
        self.progress.bar_style = "danger"
        self.status.value = error_html(error) + self._log_html()

    def _ipython_display_(self):
        show(self.widget)
