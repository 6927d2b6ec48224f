"""Every record a user meets prints as a few lines of summary computed from its data, short whatever the decode's
length (a bare `compare_decode(...)` in a notebook once printed 5.6 million characters)."""

from __future__ import annotations

import dataclasses
import pickle

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.decode.loop import GenerationResult
from moebench.inspect.compare import compare_decode
from moebench.inspect.interventions import intervene
from moebench.inspect.record import Stepper, Trace, decode
from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint

N = 64
SHORT = 2000  # characters: a screenful


@pytest.fixture(scope="module")
def shipped():
    return moebench.load()


@pytest.fixture(scope="module")
def trace(shipped):
    model, tokenizer = shipped
    return decode(model, tokenizer, "def add(a, b):", N, record=True)


def test_a_trace_prints_its_summary_in_a_few_lines(trace):
    text = repr(trace)
    assert len(text) < SHORT and len(text.splitlines()) <= 8
    assert str(trace) == text
    assert text.startswith(f"Trace: {len(trace.prompt_ids)} prompt tokens, {N} generated")
    assert f"({trace.decode_tps:.1f} tok/s)" in text and f"({trace.result().prompt_tps:.1f} tok/s)" in text
    assert f"fused switch on for {N} of {N} generated tokens" in text
    assert repr(trace.text[:72]) in text
    decisions = [r.path for s in trace.steps for r in s.layers.values()]
    fused = [d for d in decisions if d.fused]
    assert fused and f"{fused[0].path} x{len(fused)}" in text  # the counts come from the records
    assert f"{len(trace.steps)} of {len(trace.steps)} positions recorded" in text
    assert "interventions: none" in text and ".steps" in text


def test_a_trace_summary_stays_short_however_long_the_decode(trace):
    long = Trace(trace.prompt_ids, trace.steps * 16, trace.prompt_seconds, trace.decode_seconds)
    text = repr(long)
    assert len(text) < SHORT
    assert f"{len(long.generated)} generated" in text and f".steps ({len(long.steps)} StepRecords" in text


def test_a_step_prints_the_tokens_candidates_and_paths(trace):
    step = trace.generated[5]
    text = repr(step)
    assert len(text) < 1000 and str(step) == text
    assert text.startswith(f"StepRecord {step.index}: decode at position {step.position}")
    assert f"chose {step.token_text!r} ({step.token_id})" in text
    assert f"fed {step.input_text!r} ({step.input_id})" in text
    for c in step.candidates:
        assert f"{c.prob:.3f}" in text
    assert f"{len(step.layers)} MoE layers recorded" in text and ".layers[layer]" in text
    prompt = trace.steps[0]
    assert "prefill at position 0" in repr(prompt) and "the next prompt token follows" in repr(prompt)


def test_a_layer_record_prints_its_routing_not_its_vectors(trace):
    layer = trace.generated[5].layers[2]
    text = repr(layer)
    assert len(text) < 1000 and str(layer) == text
    assert f"top-{len(layer.topk_ids)} of {len(layer.router_probs)} experts" in text
    for expert, score in zip(layer.topk_ids, layer.topk_scores, strict=True):
        assert f"{expert} {score:.3f}" in text
    assert f"shared gate {layer.shared_gate:.3f}" in text
    assert f"{layer.resid_mid_norm:.4g} into the MoE block, {layer.resid_post_norm:.4g} out" in text
    assert f"path {layer.path.path}" in text and f".expert_out {list(layer.expert_out.shape)}" in text


def test_a_wide_top_k_lists_eight_experts_and_counts_the_rest(trace):
    layer = trace.generated[5].layers[2]
    wide = dataclasses.replace(layer, topk_ids=np.arange(20), topk_scores=np.linspace(0.2, 0.01, 20),
                               expert_out=np.zeros((20, layer.expert_out.shape[1]), np.float32))
    text = repr(wide)
    assert "top-20 of" in text and "0 0.200, 1 0.190," in text and "7 0.130, ... 12 more;" in text


def test_interventions_and_unrecorded_decodes_are_said(shipped):
    model, tokenizer = shipped
    ablate = moebench.Intervention(ablate=(3, 5), top_k=3)
    with intervene(model, {1: ablate, 2: ablate}):
        trace = decode(model, tokenizer, "def add(a, b):", 3, record=True)
    text = repr(trace)
    assert f"layers 1-2: ablate=(3, 5), top_k=3 (on {len(trace.steps)} of {len(trace.steps)} positions)" in text
    assert "layers 1-2: ablate=(3, 5), top_k=3" in repr(trace.steps[-1])
    layer = trace.steps[-1].layers[1]
    assert layer.path.note and f"MoE note: {layer.path.note[:40]}" in repr(layer)
    plain = decode(model, tokenizer, "def add(a, b):", 3)
    assert "internals: not recorded (record=False)" in repr(plain)
    assert "not recorded (record=False)" in repr(plain.steps[-1])
    assert "nothing decoded yet" in repr(Stepper(model, tokenizer, "hi").trace)
    ids_only = decode(model, None, [5, 17, 99], 3)
    assert f"token ids (no tokenizer): {ids_only.token_ids}" in repr(ids_only)
    assert f"chose {ids_only.token_ids[-1]}\n" in repr(ids_only.steps[-1])


@pytest.mark.parametrize("dtype", [None, mx.bfloat16])
def test_a_decode_comparison_prints_agreement_and_its_largest_differences(shipped, dtype):
    model, tokenizer = shipped
    result = compare_decode(model, "To be, or not", N, tokenizer, dtype=dtype)
    text = repr(result)
    assert len(text) < SHORT and str(result) == text
    frame = result.frame()
    assert f"greedy agreement {frame['agree'].sum()}/{N} tokens" in text
    assert f"KL(on || off) max {result.kl.max():.3g} nats (token {int(np.argmax(result.kl))})" in text
    assert f"mean {result.jaccard['jaccard'].mean():.3f}, min {result.jaccard['jaccard'].min():.3f}" in text
    gap = max(np.abs(a.logits.astype(np.float64) - b.logits).max()
              for a, b in zip(result.on.generated, result.off.generated, strict=True))
    assert f"max |on - off| {gap:.3g}" in text
    first = result.first_divergence
    if first is None:
        assert "no divergence" in text
    else:
        chosen = result.on.generated[first], result.off.generated[first]
        assert (f"first divergence at generated token {first}: on {chosen[0].token_text!r} ({chosen[0].token_id}) "
                f"vs off {chosen[1].token_text!r} ({chosen[1].token_id})") in text
    assert ".frame()" in text and ".on / .off" in text


def test_a_trace_still_pickles_and_keeps_its_data(trace):
    back = pickle.loads(pickle.dumps(trace))
    assert back.token_ids == trace.token_ids and repr(back).splitlines()[0] == repr(trace).splitlines()[0]
    assert np.array_equal(back.steps[-1].layers[0].router_probs, trace.steps[-1].layers[0].router_probs)


def test_a_generation_result_prints_counts_and_rates_not_ids():
    result = GenerationResult(list(range(4096)), [5, 6, 7], prompt_seconds=0.5, decode_seconds=0.25)
    text = repr(result)
    assert len(text) < 300 and str(result) == text
    assert "4096 prompt tokens, 3 generated" in text
    assert f"({result.prompt_tps:.1f} tok/s)" in text and "250.0 ms (8.0 tok/s)" in text


def test_a_hybrid_layer_record_names_its_token_mixing_and_its_ranges(tmp_path):
    config = {**get_preset("qwen3-next-tiny").config, "torch_dtype": "float32"}
    model, _ = moebench.load(write_random_checkpoint(tmp_path / "hybrid", config, seed=4))
    step = decode(model, None, [3, 1, 4], 2, record=True).generated[-1]
    linear, full = repr(step.layers[0]), repr(step.layers[3])
    assert linear.startswith("LayerRecord: MoE layer 0 (linear attention), path")
    assert full.startswith("LayerRecord: MoE layer 3 (full attention), path")
    r = step.layers[0]
    assert (f"linear attention per head (min-max): decay {r.decay.min():.3g}-{r.decay.max():.3g}, beta "
            f"{r.beta.min():.3g}-{r.beta.max():.3g}, state norm {r.state_norm.min():.3g}-{r.state_norm.max():.3g}"
            ) in linear
    gate = step.layers[3].output_gate_means
    assert f"full attention per head (min-max): output gate (head means) {gate.min():.3g}-{gate.max():.3g}" in full
    assert "decay" not in full and len(linear) < 1000


def test_a_layer_record_of_a_family_with_one_kind_of_attention_names_none(trace):
    text = repr(trace.generated[0].layers[0])
    assert text.startswith("LayerRecord: MoE layer 0, path") and "per head" not in text
