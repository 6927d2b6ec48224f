"""Routing drift: does a quantization, a kernel or an engine change which experts run?

The same token sequences are teacher-forced (fed, never sampled) through several variants of one model: a
loaded moebench model (with its own fused setting), a routing read from a file (moebench.inspect.routing_files:
SGLang, vLLM or moebench's parquet) or transformers' PyTorch model of a folder (`transformers_routing`). The
first variant is the reference; every other is compared with it, per token and MoE layer:

    jaccard      |A and B| / |A or B| of the two top-k expert sets
    top1_flip    the highest-scored expert differs
    router_kl    KL(reference || variant) of the router probabilities over all experts (nats), when both have them
                 and they are distributions (a sigmoid router's per-expert scores are not)
    moved        the share of the routed mix that moved: half the L1 distance between the two top-k weightings,
                 each normalised to sum 1 (0: same experts, same shares; 1: disjoint), when both have scores
    margin       the router-probability margin at the boundary that changed (k-th minus (k+1)-th probability when
                 the set changed, 1st minus 2nd when only the top-1 did), the smaller of the two variants'; for a
                 selection-biased router (GLM-4.x, DeepSeek-V3) the margin of what it chose by, the probability
                 plus its bias
    near_tie     a change whose margin is below `tie_margin` (default TIE_MARGIN): a coin toss between nearly equal
                 experts that any rounding can flip, told apart from a real flip (`real`). Without router
                 probabilities on either side no change can be called a near-tie.
    bias_made    how many of the variant's chosen experts its selection bias alone put in (not among the top-k of
                 the unbiased probabilities in the same groups), when both variants record what they chose by
    bias_change  a changed routing in which an expert that entered or left was one a selection bias put in
    logits_kl, next_top1_change   per token, when both variants are models: KL(reference || variant) of the
                 next-token distributions and whether the likeliest next token differs.

A model variant feeds each whole sequence in one forward (the prefill path) unless `stepwise`, which feeds one
token at a time through the decode step, where the fused decode-MoE kernel runs: a variant with its own fused
setting makes every model variant step (fused vs fallback then compares like with like).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import MoebenchError
from .record import Stepper, short_text, span_text
from .routing_files import Routing, read_routing

TIE_MARGIN = 1e-3  # router-probability margin below which a changed routing is a near-tie
_ROWS = 256  # logits rows compared at once (bounds the float64 copies of a large vocabulary)


@dataclass
class Variant:
    """One arm: a loaded moebench `model` (with its `tokenizer` and `fused` setting: None follows the model's
    switch) or a `routing` (from a file or transformers_routing)."""

    name: str
    model: object | None = None
    tokenizer: object | None = None
    routing: Routing | None = None
    fused: bool | None = None

    def __post_init__(self) -> None:
        if (self.model is None) == (self.routing is None):
            raise MoebenchError(f"variant {self.name!r}: give exactly one of model and routing")


def as_variant(source, name: str | None = None, fused: bool | None = None) -> Variant:
    """A Variant from a Variant, a Routing, a (model, tokenizer) pair, a model, a checkpoint folder (loaded) or a
    routing file (read_routing)."""
    if isinstance(source, Variant):
        return source
    if isinstance(source, Routing):
        return Variant(name or source.source or "routing", routing=source)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            from ..checkpoint.loader import load

            model, tokenizer = load(path)
            return Variant(name or path.name, model=model, tokenizer=tokenizer, fused=fused)
        if path.is_file():
            return Variant(name or path.name, routing=read_routing(path))
        raise MoebenchError(f"{path}: neither a checkpoint folder nor a routing file")
    if isinstance(source, tuple) and len(source) == 2:
        model, tokenizer = source
        return Variant(name or _model_name(model), model=model, tokenizer=tokenizer, fused=fused)
    if hasattr(source, "moe_blocks"):
        return Variant(name or _model_name(source), model=source, fused=fused)
    raise MoebenchError(f"a variant must be a model, a checkpoint folder, a routing file or a Routing, got "
                        f"{type(source).__name__}")


def _model_name(model) -> str:
    info = getattr(model, "load_info", None)
    return Path(info.source).name if info is not None else "model"


def token_sequences(prompts, tokenizer=None) -> list[list[int]]:
    """Prompts (a text, token ids, or a list of either) as lists of token ids; text needs a tokenizer."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                    all(isinstance(t, (int, np.integer)) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise MoebenchError("prompts must be a text, token ids, or a non-empty list of them")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise MoebenchError(f"prompt {i} is text but no variant has a tokenizer: give token ids")
            p = tokenizer.encode(p)
        ids = [int(t) for t in p]
        if not ids:
            raise MoebenchError(f"prompt {i} has no tokens")
        out.append(ids)
    return out


# -- capturing a routing --------------------------------------------------------------------------------------------
def teacher_force(model, sequences: list[list[int]], fused: bool | None = None, stepwise: bool = False,
                  name: str = "") -> Routing:
    """The routing (ids, scores, probabilities) and next-token logits `model` computes on `sequences`, fed as
    given: whole sequences through one forward, or token by token (`stepwise`) through the decode step."""
    parts: list[tuple] = []
    for ids in sequences:
        stepper = Stepper(model, None, ids if not stepwise else ids[:1], record=True, keep_logits=True, top=0,
                          fused=fused, stop_ids=(), max_tokens=len(ids) if stepwise else 1)
        records = stepper.prefill()
        if stepwise:
            records = records + [stepper.step(feed=t) for t in ids[1:]]
        stepper.close()
        parts.append(records)
    records = [r for rs in parts for r in rs]
    layers = tuple(sorted(records[0].layers))
    if not layers:
        raise MoebenchError(f"{name or 'the model'} has no MoE layer to compare")

    def stack(hook: str, dtype) -> np.ndarray | None:
        values = [[getattr(r.layers[i], hook) for i in layers] for r in records]
        if any(v is None for row in values for v in row):  # a value only some routers record (choice_scores)
            return None
        return np.stack([np.stack(row) for row in values]).astype(dtype)

    return Routing(stack("topk_ids", np.int32), layers, tokens=np.concatenate(sequences),
                   seq=np.repeat(np.arange(len(sequences)), [len(s) for s in sequences]),
                   scores=stack("topk_scores", np.float32), probs=stack("router_probs", np.float32),
                   logits=np.stack([r.logits for r in records]).astype(np.float32), source=name or "model",
                   choice=stack("choice_scores", np.float32))


def transformers_routing(folder: str | Path, sequences: list[list[int]]) -> Routing:
    """What HF transformers' PyTorch model of `folder` routes, in float32: its router logits
    (output_router_logits) through its own rule (softmax over all experts, the top-k probabilities, renormalised
    under norm_topk_prob), and its next-token logits."""
    from ..checkpoint.config import read_model_args

    folder = Path(folder)
    args = read_model_args(folder / "config.json")
    if args.quantization is not None:  # transformers would load MLX's packed weights as its own, or refuse them
        raise MoebenchError(f"{folder}: MLX-quantized, and transformers runs float checkpoints: give a float folder "
                            "(the float recipe makes one)")
    for i, seq in enumerate(sequences):  # torch would index past its embedding (an IndexError, or worse)
        bad = [t for t in seq if not 0 <= t < args.vocab_size]
        if bad:
            raise MoebenchError(f"prompt {i}: token id {bad[0]} is outside {folder.name}'s vocabulary of "
                                f"{args.vocab_size}")
    layers = tuple(i for i in range(args.num_hidden_layers) if args.is_moe_layer(i))
    import torch  # after the checks: importing it takes seconds
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001 -- transformers raises many kinds; any means it cannot run the folder
        raise MoebenchError(f"{folder}: transformers cannot load it: {type(e).__name__}: {e}") from e
    k = args.num_experts_per_tok
    ids, scores, probs, logits = [], [], [], []
    with torch.no_grad():
        for seq in sequences:
            out = hf(torch.tensor([seq]), output_router_logits=True)
            if len(out.router_logits) != len(layers):
                raise MoebenchError(f"{folder}: transformers returned {len(out.router_logits)} router outputs for "
                                    f"{len(layers)} MoE layers")
            p = np.stack([torch.softmax(r.float(), dim=-1).numpy() for r in out.router_logits], axis=1)  # [T, L, E]
            top = np.argsort(-p, axis=-1, kind="stable")[..., :k]
            s = np.take_along_axis(p, top, axis=-1)
            if args.norm_topk_prob:
                s = s / s.sum(axis=-1, keepdims=True)
            ids.append(top), scores.append(s), probs.append(p), logits.append(out.logits[0].float().numpy())
    return Routing(np.concatenate(ids), layers, tokens=np.concatenate(sequences),
                   seq=np.repeat(np.arange(len(sequences)), [len(s) for s in sequences]),
                   scores=np.concatenate(scores), probs=np.concatenate(probs), logits=np.concatenate(logits),
                   source=f"transformers {folder.name}")


# -- comparing two routings -------------------------------------------------------------------------------------
def _boundary_margin(probs: np.ndarray, k: int, top1_only: np.ndarray) -> np.ndarray:
    """Per (token, layer): p[k-1] - p[k] (the top-k boundary), or p[0] - p[1] where only the top-1 changed."""
    top = -np.sort(np.partition(-probs, min(k, probs.shape[-1] - 1), axis=-1)[..., : k + 1], axis=-1)  # descending
    boundary = top[..., k - 1] - top[..., k] if top.shape[-1] > k else top[..., k - 1]
    return np.where(top1_only, top[..., 0] - top[..., 1], boundary)


def _logits_drift(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(softmax a || softmax b) per row, in nats, and whether the argmax differs."""
    kl = np.empty(len(a))
    for start in range(0, len(a), _ROWS):
        la, lb = (x[start:start + _ROWS].astype(np.float64) for x in (a, b))
        la -= la.max(-1, keepdims=True)
        lb -= lb.max(-1, keepdims=True)
        la -= np.log(np.exp(la).sum(-1, keepdims=True))
        lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
        kl[start:start + _ROWS] = (np.exp(la) * (la - lb)).sum(-1)
    return np.maximum(kl, 0.0), a.argmax(-1) != b.argmax(-1)


def compare_routings(ref: Routing, other: Routing, tie_margin: float = TIE_MARGIN) -> dict[str, np.ndarray]:
    """Per (token, layer) drift of `other` against `ref` (arrays [T, L]; the logits columns [T]), as the module
    docstring defines them."""
    a, b = ref.ids.astype(np.int64), other.ids.astype(np.int64)
    match = a[..., :, None] == b[..., None, :]  # [T, L, Ka, Kb]
    inter = match.any(-1).sum(-1)
    jaccard = inter / (a.shape[-1] + b.shape[-1] - inter)
    top1 = a[..., 0] != b[..., 0]
    set_change = jaccard < 1
    out: dict[str, np.ndarray] = {"jaccard": jaccard, "top1_flip": top1, "set_change": set_change}
    nan = np.full(jaccard.shape, np.nan)
    distributions = ref.choice is None and other.choice is None  # a sigmoid router's scores do not sum to one
    if distributions and ref.probs is not None and other.probs is not None and ref.probs.shape == other.probs.shape:
        pa_, pb = ref.probs.astype(np.float64), other.probs.astype(np.float64)
        terms = np.where(pa_ > 0, pa_ * (np.log(np.maximum(pa_, 1e-300)) - np.log(np.maximum(pb, 1e-300))), 0.0)
        out["router_kl"] = np.maximum(terms.sum(-1), 0.0)
    else:
        out["router_kl"] = nan
    if ref.scores is not None and other.scores is not None:
        wa = ref.scores / np.maximum(ref.scores.sum(-1, keepdims=True), 1e-30)
        wb = other.scores / np.maximum(other.scores.sum(-1, keepdims=True), 1e-30)
        wb_at_a = (match * wb[..., None, :]).sum(-1)
        only_b = (wb * ~match.any(-2)).sum(-1)
        out["moved"] = 0.5 * (np.abs(wa - wb_at_a).sum(-1) + only_b)
    else:
        out["moved"] = nan
    margins = [_boundary_margin(r.probs if r.choice is None else r.choice, r.top_k, top1 & ~set_change)
               for r in (ref, other) if r.probs is not None]
    margin = np.minimum.reduce(margins) if margins else nan
    changed = set_change | top1
    out["margin"] = np.where(changed, margin, np.nan)
    out["near_tie"] = changed & (np.nan_to_num(margin, nan=np.inf) < tie_margin)
    out["real"] = changed & ~out["near_tie"]
    made_a, made_b = ref.bias_made(), other.bias_made()
    if made_a is not None and made_b is not None:
        moved_in_a, moved_in_b = ~match.any(-1), ~match.any(-2)  # chosen by one side only
        out["bias_made"] = made_b.sum(-1)
        out["bias_change"] = (moved_in_a & made_a).any(-1) | (moved_in_b & made_b).any(-1)
    else:
        out["bias_made"], out["bias_change"] = nan, np.zeros(jaccard.shape, bool)
    if ref.logits is not None and other.logits is not None:
        out["logits_kl"], out["next_top1_change"] = _logits_drift(ref.logits, other.logits)
    return out


# -- the whole comparison ---------------------------------------------------------------------------------------
FRAME_COLUMNS = ["variant", "seq", "pos", "token", "layer", "jaccard", "top1_flip", "set_change", "router_kl",
                 "moved", "margin", "near_tie", "real", "bias_made", "bias_change", "logits_kl", "next_top1_change"]


@dataclass
class Drift:
    """Every variant's routing on the same tokens and its drift from the reference (the first). See the module
    docstring for the measures; the frames hold them, the repr summarises."""

    names: list[str]
    routings: dict[str, Routing]
    tokens: np.ndarray
    seq: np.ndarray
    layers: tuple[int, ...]
    tie_margin: float
    tokenizer: object | None = None
    _frame: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def reference(self) -> str:
        return self.names[0]

    def frame(self) -> pd.DataFrame:
        """One row per (variant, token, layer) for every variant but the reference."""
        if self._frame is None:
            ref = self.routings[self.reference]
            t, n_layers = len(self.tokens), len(self.layers)
            pos = np.concatenate([np.arange(n) for n in np.bincount(self.seq)])
            frames = []
            for name in self.names[1:]:
                d = compare_routings(ref, self.routings[name], self.tie_margin)
                cols = {"variant": name, "seq": np.repeat(self.seq, n_layers), "pos": np.repeat(pos, n_layers),
                        "token": np.repeat(self.tokens, n_layers), "layer": np.tile(self.layers, t)}
                for key in FRAME_COLUMNS[5:]:
                    if key in ("logits_kl", "next_top1_change"):
                        value = d.get(key)
                        cols[key] = np.repeat(value, n_layers) if value is not None else pd.NA
                    else:
                        cols[key] = d[key].reshape(-1)
                frames.append(pd.DataFrame(cols, columns=FRAME_COLUMNS))
            self._frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=FRAME_COLUMNS)
        return self._frame

    def by_layer(self) -> pd.DataFrame:
        """Per variant and layer: mean Jaccard, how many tokens flipped top-1, changed set, were near-ties or real
        changes, or changes of a bias-made choice, mean router KL and moved share."""
        return (self.frame().groupby(["variant", "layer"], sort=False)
                .agg(tokens=("jaccard", "size"), jaccard=("jaccard", "mean"), top1_flips=("top1_flip", "sum"),
                     set_changes=("set_change", "sum"), near_ties=("near_tie", "sum"), real=("real", "sum"),
                     bias_changes=("bias_change", "sum"), router_kl=("router_kl", "mean"),
                     moved=("moved", "mean")).reset_index())

    def by_token(self) -> pd.DataFrame:
        """Per variant and token: layers changed (real and near-tie), and the next-token drift there."""
        f = self.frame()
        out = (f.groupby(["variant", "seq", "pos"], sort=False)
               .agg(token=("token", "first"), changed=("jaccard", lambda j: int((j < 1).sum())),
                    top1_flips=("top1_flip", "sum"), real=("real", "sum"), near_ties=("near_tie", "sum"),
                    logits_kl=("logits_kl", "first"), next_top1_change=("next_top1_change", "first"))
               .reset_index())
        out.insert(4, "text", [self._text([t]) for t in out["token"]])
        return out

    def by_expert(self) -> pd.DataFrame:
        """Per variant, layer and expert: tokens routed to it by the reference and by the variant, how many it lost
        (reference only) and gained (variant only)."""
        ref = self.routings[self.reference].ids
        n_experts = int(max(r.ids.max() for r in self.routings.values())) + 1
        rows = []
        for name in self.names[1:]:
            other = self.routings[name].ids
            for li, layer in enumerate(self.layers):
                a, b = _onehot(ref[:, li], n_experts), _onehot(other[:, li], n_experts)
                for e in range(n_experts):
                    rows.append((name, layer, e, int(a[:, e].sum()), int(b[:, e].sum()),
                                 int((a[:, e] & ~b[:, e]).sum()), int((b[:, e] & ~a[:, e]).sum())))
        return pd.DataFrame(rows, columns=["variant", "layer", "expert", "reference", "tokens", "lost", "gained"])

    def worst(self, n: int = 10, context: int = 6, variant: str | None = None) -> pd.DataFrame:
        """The n tokens with the most real routing changes (then largest next-token KL), of every variant or of
        `variant`, each with its `index` into the concatenated tokens and in its context (Drift.context)."""
        t = self.by_token()
        if variant is not None:
            self._check_variant(variant)
            t = t[t["variant"] == variant]
        t = t.sort_values(["real", "changed", "logits_kl"], ascending=False, kind="stable").head(n).copy()
        t.insert(3, "index", (self._starts()[t["seq"].to_numpy()] + t["pos"].to_numpy()).astype(int))
        t["context"] = [self.context(i, context) for i in t["index"]]
        return t.reset_index(drop=True)

    def context(self, index: int, n: int = 6) -> str:
        """Token `index` (into the concatenated tokens) in [brackets], with up to `n` tokens of its own sequence
        either side."""
        self._check_index(index)
        starts, s = self._starts(), self.seq[index]
        lo, hi = max(starts[s], index - n), min(starts[s + 1], index + n + 1)
        return (f"{self._text(self.tokens[lo:index])}[{self._text(self.tokens[index:index + 1])}]"
                f"{self._text(self.tokens[index + 1:hi])}")

    def _starts(self) -> np.ndarray:
        """Where each sequence starts in the concatenated tokens, and the end."""
        return np.concatenate([[0], np.cumsum(np.bincount(self.seq))])

    def _check_variant(self, variant: str) -> None:
        if variant not in self.routings or variant == self.reference:
            raise MoebenchError(f"variant must be one of {self.names[1:]}, got {variant!r}")

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self.tokens):
            raise MoebenchError(f"index must be in 0..{len(self.tokens) - 1}, got {index!r}")

    def cell(self, variant: str, index: int, layer: int) -> pd.DataFrame:
        """Both routings at one token (index into the concatenated tokens) and layer: each variant's experts,
        scores and router probabilities, one row per (arm, rank)."""
        self._check_variant(variant)
        if layer not in self.layers:
            raise MoebenchError(f"layer must be one of the MoE layers {list(self.layers)}, got {layer!r}")
        self._check_index(index)
        li = self.layers.index(layer)
        rows = []
        for arm in (self.reference, variant):
            r = self.routings[arm]
            for rank, e in enumerate(r.ids[index, li].tolist()):
                rows.append({"arm": arm, "rank": rank, "expert": e,
                             "score": np.nan if r.scores is None else float(r.scores[index, li, rank]),
                             "prob": np.nan if r.probs is None else float(r.probs[index, li, e])})
        return pd.DataFrame(rows)

    def next_tokens(self, variant: str, index: int, top: int = 5) -> pd.DataFrame:
        """The likeliest next tokens after token `index` under the reference and `variant` (both models), with
        both probabilities: what the routing change did to the prediction there."""
        self._check_variant(variant)
        self._check_index(index)
        a, b = self.routings[self.reference].logits, self.routings[variant].logits
        if a is None or b is None:
            raise MoebenchError("next-token logits need two model variants (a routing file has none)")
        pa_, pb = (np.exp(x - x.max()) for x in (a[index].astype(np.float64), b[index].astype(np.float64)))
        pa_, pb = pa_ / pa_.sum(), pb / pb.sum()
        ids = list(dict.fromkeys([*np.argsort(-pa_)[:top].tolist(), *np.argsort(-pb)[:top].tolist()]))
        return pd.DataFrame({"token": ids, "text": [self._text([i]) for i in ids],
                             self.reference: pa_[ids], variant: pb[ids]})

    def _text(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        """A summary line per variant and the worst layer; the data stays in the frames."""
        f = self.frame()
        n_seq = len(np.unique(self.seq))
        lines = [f"Drift: {len(self.names) - 1} variant(s) against {self.reference!r} over {len(self.tokens)} tokens "
                 f"({n_seq} sequence(s)), MoE layers {span_text(self.layers)}, top-"
                 f"{self.routings[self.reference].top_k}; near-tie: router-probability margin < {self.tie_margin:g}"]
        for name, g in f.groupby("variant", sort=False):
            per_token = (g["set_change"] | g["top1_flip"]).groupby([g["seq"], g["pos"]]).any()
            changed = g["set_change"] | g["top1_flip"]
            text = (f"  {name}: Jaccard {g['jaccard'].mean():.3f}; token-layers changed {changed.mean():.1%} (real "
                    f"{g['real'].mean():.1%}, near-ties {g['near_tie'].mean():.1%}), top-1 flips "
                    f"{g['top1_flip'].mean():.1%}; tokens changed in some layer {per_token.mean():.1%}")
            if g["router_kl"].notna().any():
                text += f", router KL {g['router_kl'].mean():.3g}, moved {g['moved'].mean():.3g}"
            if g["bias_made"].notna().any():
                text += (f"; chosen by the selection bias alone {g['bias_made'].mean():.2f} experts a token-layer, "
                         f"changes of a bias-made choice {g['bias_change'].mean():.1%}")
            if g["logits_kl"].notna().any():
                text += (f"; next-token KL {g['logits_kl'].astype(float).mean():.3g}, likeliest next token changed at "
                         f"{g.drop_duplicates(['seq', 'pos'])['next_top1_change'].astype(bool).mean():.1%}")
            lines.append(text)
        if not len(f) or not ((f["jaccard"] < 1).any() or f["top1_flip"].any() or (f["router_kl"] > 0).any()):
            lines.append("  no routing drift: the same experts with the same probabilities at every token and layer")
        else:
            layer = self.by_layer().sort_values(["jaccard", "router_kl"], ascending=[True, False],
                                                kind="stable").iloc[0]
            lines.append(f"  most drift: layer {int(layer['layer'])} of {layer['variant']} (Jaccard "
                         f"{layer['jaccard']:.3f}, {int(layer['real'])} real changes, {int(layer['near_ties'])} "
                         f"near-ties in {int(layer['tokens'])} tokens)")
            worst = self.worst(1)
            if len(worst) and worst["changed"].iloc[0]:
                lines.append(f"  most changed token: {short_text(worst['context'].iloc[0], 60)}")
        lines.append("  data: .frame(), .by_layer(), .by_expert(), .by_token(), .worst(n), .cell(...), .routings")
        return "\n".join(lines)


def _onehot(ids: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((len(ids), n), bool)
    np.put_along_axis(out, ids.astype(np.int64), True, axis=1)
    return out


def drift(variants: Sequence, prompts, tokenizer=None, tie_margin: float = TIE_MARGIN,
          stepwise: bool | None = None, names: Sequence[str] | None = None) -> Drift:
    """Teacher-force `prompts` through every variant (as_variant: models, folders, routing files, Routings) and
    compare each with the first. stepwise None: token by token when a variant sets its own fused switch."""
    if len(variants) < 2:
        raise MoebenchError(f"drift needs at least two variants (a reference and one to compare), got {len(variants)}")
    if names is not None and len(names) != len(variants):
        raise MoebenchError(f"names: {len(names)} names for {len(variants)} variants")
    if not isinstance(tie_margin, (int, float)) or tie_margin < 0:
        raise MoebenchError(f"tie_margin must be a number >= 0, got {tie_margin!r}")
    arms = [as_variant(v, None if names is None else names[i]) for i, v in enumerate(variants)]
    if len({a.name for a in arms}) != len(arms):
        raise MoebenchError(f"variant names must differ, got {[a.name for a in arms]}: pass names=")
    tokenizer = tokenizer or next((a.tokenizer for a in arms if a.tokenizer is not None), None)
    sequences = token_sequences(prompts, tokenizer)
    for arm in (a for a in arms if a.model is not None):
        _check_vocabulary(arm, sequences)
    tokens = np.concatenate(sequences)
    if stepwise is None:
        stepwise = any(a.fused is not None for a in arms)
    routings = {}
    for arm in arms:
        r = arm.routing if arm.routing is not None else teacher_force(arm.model, sequences, arm.fused, stepwise,
                                                                        arm.name)
        _check_aligned(arm.name, r, tokens, routings[arms[0].name] if routings else None)
        routings[arm.name] = r
    seq = np.repeat(np.arange(len(sequences)), [len(s) for s in sequences])
    return Drift([a.name for a in arms], routings, tokens, seq, routings[arms[0].name].layers, float(tie_margin),
                 tokenizer)


def _check_vocabulary(arm: Variant, sequences: list[list[int]]) -> None:
    """Every token id a model variant is fed is one of its vocabulary's, named with its prompt otherwise."""
    vocab = arm.model.args.vocab_size
    for i, seq in enumerate(sequences):
        bad = [t for t in seq if not 0 <= t < vocab]
        if bad:
            raise MoebenchError(f"prompt {i}: token id {bad[0]} is outside the vocabulary of variant {arm.name!r} "
                                f"(ids 0..{vocab - 1})")


def _check_aligned(name: str, r: Routing, tokens: np.ndarray, ref: Routing | None) -> None:
    """A routing covers exactly the fed tokens and the reference's number of MoE layers."""
    where = f"variant {name!r} ({r.source})"
    if len(r) != len(tokens):
        raise MoebenchError(f"{where}: {len(r)} routed tokens, but the prompts hold {len(tokens)}")
    if r.tokens is not None and not np.array_equal(r.tokens, tokens):
        first = int(np.argmax(r.tokens != tokens))
        raise MoebenchError(f"{where}: token {first} is {int(r.tokens[first])}, the prompts have {int(tokens[first])}")
    if ref is not None and len(r.layers) != len(ref.layers):
        raise MoebenchError(f"{where}: {len(r.layers)} MoE layers, the reference has {len(ref.layers)}")
