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

from ..checkpoint.quant import QuantizedParts
from ..errors import MoebenchError, UnsupportedKernelConfig
from ..execution import moe as fused_kernel
from ..execution.dispatch import DispatchCounter, fused_moe, routed_experts
from ..models.switch import SwitchGLU
from .interventions import active_interventions, set_interventions
from .record import Stepper, StepRecord, Trace

PAIRS = (("fused", "truth"), ("fallback", "truth"), ("fused", "fallback"))


def activation_dtype(model) -> mx.Dtype:
    return model.norm.weight.dtype


def with_dtype(model, dtype: mx.Dtype | None):
    """The model itself when it already runs `dtype` (or dtype is None), else a copy loaded from its
    checkpoint with that activation dtype, carrying the same interventions."""
    if dtype is None or dtype == activation_dtype(model):
        return model
    from ..checkpoint.loader import load

    info = getattr(model, "load_info", None)
    if info is None:
        raise MoebenchError("dtype needs a model opened with moebench.load (its checkpoint is reloaded)")
    copy, _ = load(info.source, dtype=dtype)
    set_interventions(copy, active_interventions(model))
    return copy


# -- the dense truth -------------------------------------------------------------------------------
def unpack(weight: np.ndarray, bits: int) -> np.ndarray:
    """Packed uint32 words [..., packed] -> integer levels [..., packed * 32 / bits] (LSB-first bitstream)."""
    stream = np.unpackbits(np.ascontiguousarray(weight, dtype="<u4").view(np.uint8), axis=-1, bitorder="little")
    stream = stream.reshape(*weight.shape[:-1], -1, bits).astype(np.int64)
    return (stream << np.arange(bits)).sum(axis=-1)


def dequantize_f64(parts: QuantizedParts, ids: np.ndarray | None = None) -> np.ndarray:
    """The selected experts' matrices [K, out, in] (or, without ids, the one matrix) in float64 from the
    packed weights; scales and biases are upcast (from whatever float they are stored in) before the
    affine map."""
    if parts.mode != "affine" or parts.biases is None:
        raise UnsupportedKernelConfig(f"the dense truth handles affine quantization with biases, not {parts.mode}")
    take = (lambda a: a[mx.array(ids)]) if ids is not None else (lambda a: a)
    levels = unpack(np.array(take(parts.weight)), parts.bits)
    scales = np.array(take(parts.scales).astype(mx.float32)).astype(np.float64)
    biases = np.array(take(parts.biases).astype(mx.float32)).astype(np.float64)
    gs = parts.group_size
    return levels * np.repeat(scales, gs, axis=-1) + np.repeat(biases, gs, axis=-1)


def _swiglu_f64(parts: list[QuantizedParts | None], x: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """Unweighted SwiGLU output(s) of gate/up/down `parts` on one token x [D], all in float64."""
    if any(p is None for p in parts):
        raise UnsupportedKernelConfig("float weights: the fused kernels need quantized weights")
    gate, up, down = (dequantize_f64(p, ids) for p in parts)
    xf = x.astype(np.float64)
    g, u = gate @ xf, up @ xf
    return (down @ (g / (1.0 + np.exp(-g)) * u)[..., None])[..., 0]


def dense_truth(experts: SwitchGLU, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Unweighted SwiGLU outputs [K, D] of experts `ids` on one token x [D], all in float64."""
    return _swiglu_f64(experts.quantized_parts(), x, ids)


def nrms(a: np.ndarray, ref: np.ndarray) -> float:
    """RMS of (a - ref) over RMS of ref."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    denom = np.sqrt(np.mean(ref**2))
    return float(np.sqrt(np.mean((a - ref) ** 2)) / denom) if denom else float(np.sqrt(np.mean(a**2)))


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


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
    m = with_dtype(model, dtype)
    act = activation_dtype(m)
    rows = []
    for layer in layers:
        rec = step.layers[layer]
        block = m.moe_blocks()[layer]
        # The block input, rebuilt from the recorded residual with the layer's own norm (the same op).
        x = m.layers[layer].post_attention_layernorm(mx.array(rec.resid_mid)[None].astype(act))
        ids = mx.array(rec.topk_ids.astype(np.uint32))[None]
        scores = mx.array(rec.topk_scores.astype(np.float32))[None]
        outputs = {}
        for name, switch in (("fused", True), ("fallback", False)):
            with fused_moe(switch):
                routed, per_expert, decision = routed_experts(block.experts, x, ids, scores, DispatchCounter())
            if switch and not decision.fused:
                raise UnsupportedKernelConfig(f"layer {layer}: the fused kernel declines: {decision.reason}")
            outputs[name] = (_f64(routed[0]), _f64(per_expert[0]), decision.path)
        s64 = rec.topk_scores.astype(np.float64)
        truth = dense_truth(block.experts, _f64(x[0]), rec.topk_ids)
        shared = _shared_outputs(block, x, ids, scores, outputs["fused"][2])
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


def _shared_outputs(block, x: mx.array, ids: mx.array, scores: mx.array, backend: str) -> dict | None:
    """The shared expert's unweighted output [D] three ways: inside the fused kernel pair (or beside it,
    as the fused path runs it when it cannot fold), as the fallback's MLP, and in float64."""
    mlp = block.shared_expert
    if mlp is None:
        return None
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    fallback = _f64(mlp(x)[0])
    w = block.dispatch.fused_weights(block.experts, projections)
    fused = fallback
    if w.shared is not None:
        unit_gate = mx.ones((*x.shape[:-1], 1), mx.float32)  # the output is unweighted: the gate does not enter it
        _, _, ys = fused_kernel.routed(backend, x, ids, scores, *w.experts,
                                       fused_kernel.SharedExpert(*w.shared, unit_gate))
        fused = _f64(ys[0])
    truth = _swiglu_f64([p.quantized_parts() for p in projections], _f64(x[0]))
    return {"fused": fused, "fallback": fallback, "truth": truth}


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
                            pd.DataFrame(jaccard, columns=["step", "layer", "jaccard"]), str(activation_dtype(m)))
