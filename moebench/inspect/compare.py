"""Fused vs fallback, measured two ways.

compare_step: one recorded step, one or all MoE layers. Both paths run the layer's routed experts on
the same block input with the routing the step recorded (identical ids and scores), and each is
measured against a dense truth: the packed weights unpacked by numpy (independently of MLX),
scales and biases upcast before dequantizing, every product accumulated in float64.

compare_decode: greedy decodes with the switch on and off from one prompt, run in lockstep and fed
the same tokens (the fused arm's), so every step compares like with like: the first step where the
two arms would choose differently, the top-1 margin there, per-token KL between the next-token
distributions and per-layer routing agreement (Jaccard of the top-k sets).

`dtype` runs either comparison on a copy of the model loaded with that activation dtype (e.g.
mx.bfloat16 on CPU, where the model otherwise runs float32 and the two paths barely differ). Each
call reloads; to compare many steps, load the copy once with `with_dtype` and pass it instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pandas as pd

from ..errors import MoebenchError, UnsupportedKernelConfig
from ..execution import moe, support
from ..execution.executor import executor
from ..execution.kernel import available_backend
from ..models.sharding import describe, shard_of
from .interventions import active_interventions, set_interventions
from .record import Stepper, StepRecord, Trace, span_text, token_label
from .truth import expert_outputs, f64, nrms

PAIRS = (("fused", "truth"), ("fallback", "truth"), ("fused", "fallback"))


def with_dtype(model, dtype: mx.Dtype | None):
    """The model itself when it already runs `dtype` (or dtype is None), else a copy loaded from its
    checkpoint with that activation dtype, carrying the same interventions."""
    if dtype is None or dtype == model.dtype:
        return model
    from ..checkpoint.loader import load

    info = getattr(model, "load_info", None)
    if info is None:
        raise MoebenchError("dtype needs a model opened with moebench.load (its checkpoint is reloaded)")
    copy, _ = load(info.source, dtype=dtype)
    set_interventions(copy, active_interventions(model))
    return copy


# -- (a) one step, identical inputs and routing ---------------------------------------------------
def compare_step(model, step: StepRecord, layers: list[int] | None = None, dtype: mx.Dtype | None = None
                 ) -> pd.DataFrame:
    """Errors of fused and fallback vs the dense truth and vs each other, for a step recorded with
    `record=True`. Long format: one row per (layer, part, pair); part 'routed' is the weighted sum of
    the routed experts (after the paths' own final cast), part 'expert' each selected expert's
    score-weighted partial (slot = rank by score), part 'shared' the shared expert's unweighted output
    (score: its recorded gate) where the family has one."""
    if not step.layers:
        raise MoebenchError("this step has no recorded layers: decode with record=True")
    layers = sorted(step.layers) if layers is None else layers
    missing = [i for i in layers if i not in step.layers]
    if missing:
        raise MoebenchError(f"layer {missing[0]} was not recorded (recorded MoE layers: {sorted(step.layers)})")
    if (shard := shard_of(model)) is not None:  # its per-expert truths read every expert's weights
        raise MoebenchError(f"compare needs every expert in one process; this one holds {describe(shard)}: load the "
                            "checkpoint without shard= to compare its paths")
    m = with_dtype(model, dtype)
    act, backend = m.dtype, available_backend()
    rows = []
    for layer in layers:
        rec = step.layers[layer]
        block = m.moe_blocks()[layer]
        # The block input, rebuilt from the recorded residual with the layer's own norm (the same op).
        x = m.layers[layer].post_attention_layernorm(mx.array(rec.resid_mid)[None].astype(act))
        ids = mx.array(rec.topk_ids.astype(np.uint32))[None]
        scores = mx.array(rec.topk_scores.astype(np.float32))[None]
        experts = block.parts().experts
        reason = support.moe_reason(block.spec, experts.quantized_parts(), backend, executor(m).settings.max_dff)
        if reason:
            raise UnsupportedKernelConfig(f"layer {layer}: the fused kernel declines: {reason}")
        outputs = {}
        for name, path in (("fused", backend), ("fallback", "fallback")):
            routed, per_expert = moe.routed_experts(path, experts, x, ids, scores)
            outputs[name] = (f64(routed[0]), f64(per_expert[0]), path)
        s64 = rec.topk_scores.astype(np.float64)
        truth = expert_outputs(_parts(experts), f64(x[0]), rec.topk_ids, moe.expert_variant(experts))
        shared = _shared_outputs(m, layer, x, ids, scores, backend)
        outputs["truth"] = ((s64[:, None] * truth).sum(axis=0), truth, "numpy float64")
        for a, b in PAIRS:
            routed_a, experts_a, _ = outputs[a]
            routed_b, experts_b, _ = outputs[b]
            base = {"layer": layer, "pair": f"{a}~{b}", "backend": outputs["fused"][2], "dtype": str(act)}
            rows.append({**base, "part": "routed", "slot": pd.NA, "expert": pd.NA, "score": pd.NA,
                         "nrms": nrms(routed_a, routed_b), "max_abs": float(np.abs(routed_a - routed_b).max())})
            for slot, expert in enumerate(rec.topk_ids):
                pa, pb = s64[slot] * experts_a[slot], s64[slot] * experts_b[slot]
                rows.append({**base, "part": "expert", "slot": slot, "expert": int(expert), "score": s64[slot],
                             "nrms": nrms(pa, pb), "max_abs": float(np.abs(pa - pb).max())})
            if shared is not None:
                sa, sb = shared[a], shared[b]
                rows.append({**base, "part": "shared", "slot": pd.NA, "expert": pd.NA,
                             "score": float(np.asarray(rec.shared_gate).reshape(-1)[0]), "nrms": nrms(sa, sb),
                             "max_abs": float(np.abs(sa - sb).max())})
    frame = pd.DataFrame(rows, columns=["layer", "part", "slot", "expert", "score", "pair", "nrms", "max_abs",
                                        "backend", "dtype"])
    return frame.astype({"slot": "Int64", "expert": "Int64", "score": "Float64"})


def _parts(module) -> list:
    return [p.quantized_parts() for p in (module.gate_proj, module.up_proj, module.down_proj)]


def _shared_outputs(model, layer: int, x: mx.array, ids: mx.array, scores: mx.array, backend: str) -> dict | None:
    """The shared expert's unweighted output [D] three ways: inside the fused kernel pair (or beside it,
    as the fused path runs it when it cannot fold), as the fallback's MLP, and in float64."""
    parts = model.moe_blocks()[layer].parts()
    if parts.shared is None:
        return None
    mlp = parts.shared
    fallback = f64(mlp(x)[0])
    w = executor(model).weights[layer].fused(parts)
    fused = fallback
    if w.shared is not None:
        unit_gate = mx.ones((*x.shape[:-1], 1), mx.float32)  # the output is unweighted: the gate does not enter it
        _, _, ys = moe.routed(backend, x, ids, scores, *w.experts, moe.SharedExpert(*w.shared, unit_gate))
        fused = f64(ys[0])
    return {"fused": fused, "fallback": fallback, "truth": expert_outputs(_parts(mlp), f64(x[0]))}


# -- (b) whole decode, switch on vs off ------------------------------------------------------------
@dataclass
class DecodeComparison:
    """Greedy decodes with the fused switch on (`on`) and off (`off`), the off arm fed the on arm's tokens.

    first_divergence: index (into the generated tokens) of the first step where the arms choose
    different tokens, None when they agree throughout; up to there the free-running off decode is
    identical to `off`. margins: at that step, each arm's top-1 minus top-2 logit and probability.
    kl: per generated token, KL(p_on || p_off) in nats. jaccard: long format (step, layer, jaccard).
    """

    on: Trace
    off: Trace
    first_divergence: int | None
    margins: dict[str, dict[str, float]] | None
    kl: np.ndarray
    jaccard: pd.DataFrame
    dtype: str

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    def frame(self) -> pd.DataFrame:
        """One row per generated token: both arms' choices, KL and the mean routing agreement."""
        mean_j = self.jaccard.groupby("step")["jaccard"].mean()
        return pd.DataFrame({
            "step": np.arange(len(self.kl)),
            "token_on": self.on.token_ids, "token_off": self.off.token_ids,
            "agree": [a == b for a, b in zip(self.on.token_ids, self.off.token_ids, strict=True)],
            "kl": self.kl, "mean_jaccard": mean_j.reindex(range(len(self.kl))).to_numpy(),
        })

    def __repr__(self) -> str:
        """A summary: agreement, the first divergence, the largest differences; the data stays in the fields."""
        on, off = self.on.generated, self.off.generated
        agree = sum(a.token_id == b.token_id for a, b in zip(on, off, strict=True))
        if self.first_divergence is None:
            divergence = "no divergence: the arms choose the same token at every step"
        else:
            i, m = self.first_divergence, self.margins
            divergence = (f"first divergence at generated token {i}: on {token_label(on[i].token_id, on[i].token_text)}"
                          f" vs off {token_label(off[i].token_id, off[i].token_text)}; top-1 margin there "
                          f"{m['on']['logit']:.3g} (on), {m['off']['logit']:.3g} (off) logits")
        logits = max(float(np.abs(a.logits.astype(np.float64) - b.logits).max()) for a, b in zip(on, off, strict=True))
        worst = int(np.argmax(self.kl))
        low = self.jaccard.loc[self.jaccard["jaccard"].idxmin()]
        where = f" (token {int(low['step'])}, layer {int(low['layer'])})" if low["jaccard"] < 1 else ""
        return "\n".join([
            f"DecodeComparison: fused switch on vs off, greedy, {self.dtype.removeprefix('mlx.core.')}, "
            f"{len(self.on.prompt_ids)} prompt + {len(on)} generated tokens",
            f"  greedy agreement {agree}/{len(on)} tokens (the off arm fed the on arm's tokens)",
            f"  {divergence}",
            f"  next-token logits: max |on - off| {logits:.3g}; KL(on || off) max {self.kl[worst]:.3g} nats "
            f"(token {worst}), mean {float(self.kl.mean()):.3g}",
            f"  routing agreement (top-k Jaccard, MoE layers {span_text(self.jaccard['layer'])}): mean "
            f"{self.jaccard['jaccard'].mean():.3f}, min {low['jaccard']:.3f}{where}",
            "  data: .frame() (one row per token), .kl, .jaccard, .margins, .on / .off (Traces)",
        ])


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max()
    return z - np.log(np.exp(z).sum())


def _margin(logits: np.ndarray) -> dict[str, float]:
    top2 = np.sort(logits.astype(np.float64))[-2:]
    p = np.exp(_log_softmax(logits))
    p2 = np.sort(p)[-2:]
    return {"logit": float(top2[1] - top2[0]), "prob": float(p2[1] - p2[0])}


def compare_decode(model, prompt: str | list[int], n: int, tokenizer=None, dtype: mx.Dtype | None = None
                   ) -> DecodeComparison:
    """Greedy n tokens with the fused switch on vs off (same prompt, same fed tokens), see DecodeComparison."""
    m = with_dtype(model, dtype)
    on = Stepper(m, tokenizer, prompt, record=True, keep_logits=True, fused=True, max_tokens=n)
    off = Stepper(m, tokenizer, prompt, record=True, keep_logits=True, fused=False, stop_ids=())
    pairs = [(on.prefill()[-1], off.prefill()[-1])]
    while not on.done:
        a = on.step()
        pairs.append((a, off.step(feed=a.input_id)))
    off.close()
    kl, jaccard, first, margins = [], [], None, None
    for i, (a, b) in enumerate(pairs):
        la, lb = _log_softmax(a.logits), _log_softmax(b.logits)
        kl.append(float(np.sum(np.exp(la) * (la - lb))))
        for layer, ra in a.layers.items():
            sa, sb = set(ra.topk_ids.tolist()), set(b.layers[layer].topk_ids.tolist())
            jaccard.append({"step": i, "layer": layer, "jaccard": len(sa & sb) / len(sa | sb)})
        if first is None and a.token_id != b.token_id:
            first, margins = i, {"on": _margin(a.logits), "off": _margin(b.logits)}
    return DecodeComparison(on.trace, off.trace, first, margins, np.array(kl),
                            pd.DataFrame(jaccard, columns=["step", "layer", "jaccard"]), str(m.dtype))
