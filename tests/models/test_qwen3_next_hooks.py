"""The hybrids' token-mixing hook points (moebench.models.hooks' `mixer` names), recorded by a Stepper on tiny
Qwen3-Next and Qwen3.5-MoE checkpoints written by make-random (three Gated DeltaNet layers, then a gated full-attention
layer), against independent numpy computations from the layers' weights: decay and beta from the gates' formula on
in_proj_ba / in_proj_b, in_proj_a; silu(z) and sigmoid(gate) from the projections; the state norm from the delta
state the cache holds after the step. The fused switch changes nothing the token mixing records."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.inspect.record import Recorder, Stepper
from moebench.models import qwen3_next
from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint

PROMPT = [7, 3, 19, 101, 5]
PRESETS = {"qwen3_next": "qwen3-next-tiny", "qwen3_5_moe": "qwen3.5-moe-tiny"}
TOLERANCE = 1e-5


def hybrid_folder(root: Path, family: str, bits: int | None = None) -> Path:
    config = {**get_preset(PRESETS[family]).config, "torch_dtype": "float32"}
    if bits is None:
        return write_random_checkpoint(root / family, config, seed=3)
    return write_random_checkpoint(root / f"{family}-{bits}bit", config, seed=3, bits=bits, layout="stacked")


@pytest.fixture(scope="module", params=sorted(PRESETS))
def hybrid(request, tmp_path_factory):
    """A float hybrid of each family and its recorded decode (no pipelining: the cache ends at the last record)."""
    model, _ = moebench.load(hybrid_folder(tmp_path_factory.mktemp("hooks"), request.param))
    stepper = Stepper(model, None, PROMPT, record=True, pipeline=False)
    return model, stepper, stepper.run(4)


def weight(module) -> np.ndarray:
    return np.array(module["weight"], dtype=np.float64)


def normed_input(model, layer: int, resid_pre: np.ndarray) -> np.ndarray:
    """input_layernorm of the residual entering `layer` (RMSNorm, the weight as held)."""
    norm = model.layers[layer].input_layernorm
    x = resid_pre.astype(np.float64)
    return x / np.sqrt(np.mean(x**2) + norm.eps) * weight(norm)


def linear_projections(mixer, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z [Hv, Dv], b [Hv], a [Hv]) of one normed input, from the stored matrices' row layout."""
    lin = mixer.linear
    nk, nv, dk, dv = lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim
    if lin.layout == qwen3_next.SPLIT_QKV_Z_B_A:
        return ((weight(mixer.in_proj_z) @ x).reshape(nv, dv), weight(mixer.in_proj_b) @ x,
                weight(mixer.in_proj_a) @ x)
    per_key = nv // nk  # rows per key head: q, k, its value heads' v, then their z; b's then a's
    z = (weight(mixer.in_proj_qkvz) @ x).reshape(nk, -1)[:, 2 * dk + per_key * dv :].reshape(nv, dv)
    ba = (weight(mixer.in_proj_ba) @ x).reshape(nk, 2, per_key)
    return z, ba[:, 0].reshape(nv), ba[:, 1].reshape(nv)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def test_every_layer_records_its_kind_and_only_linear_layers_their_gates(hybrid):
    model, _, trace = hybrid
    kinds = [layer.layer_type for layer in model.layers]
    assert kinds == [qwen3_next.LINEAR] * 3 + [qwen3_next.FULL]
    lin, attn = model.layers[0].linear_attn.linear, model.layers[3].self_attn
    for step in trace.steps:
        assert [step.layers[i].mixer_kind for i in range(4)] == kinds
        for i, kind in enumerate(kinds):
            r = step.layers[i]
            if kind == qwen3_next.LINEAR:
                assert r.decay.shape == r.beta.shape == (lin.num_value_heads,)
                assert r.output_gate.shape == (lin.num_value_heads, lin.value_head_dim)
            else:
                assert r.decay is None and r.beta is None and r.state_norm is None
                assert r.output_gate.shape == (attn.n_heads, attn.head_dim)


def test_decay_beta_and_silu_z_equal_the_formulas_on_the_layer_weights(hybrid):
    model, _, trace = hybrid
    for step in trace.steps:
        for i in range(3):
            r, mixer = step.layers[i], model.layers[i].linear_attn
            z, b, a = linear_projections(mixer, normed_input(model, i, r.resid_pre))
            softplus = np.log1p(np.exp(a + np.array(mixer["dt_bias"], dtype=np.float64)))
            decay = np.exp(-np.exp(np.array(mixer["A_log"], dtype=np.float64)) * softplus)
            assert np.abs(r.decay - decay).max() <= TOLERANCE
            assert np.abs(r.beta - sigmoid(b)).max() <= TOLERANCE
            assert np.abs(r.output_gate - z * sigmoid(z)).max() <= TOLERANCE


def test_full_attention_output_gate_is_sigmoid_of_the_gate_rows_of_q_proj(hybrid):
    model, _, trace = hybrid
    attn = model.layers[3].self_attn
    for step in trace.steps:
        r = step.layers[3]
        q = (weight(attn.q_proj) @ normed_input(model, 3, r.resid_pre)).reshape(attn.n_heads, 2 * attn.head_dim)
        assert np.abs(r.output_gate - sigmoid(q[:, attn.head_dim :])).max() <= TOLERANCE


def test_state_norm_is_the_norm_of_the_cached_state_after_the_step(hybrid):
    _, stepper, trace = hybrid
    last = trace.steps[-1]
    for i in range(3):
        state = np.array(stepper.session.cache[i].delta[0], dtype=np.float64)  # [Hv, Dv, Dk]
        assert np.abs(last.layers[i].state_norm - np.linalg.norm(state, axis=(-2, -1))).max() <= TOLERANCE
    prompt = trace.prefill
    assert all(s.layers[0].state_norm is None for s in prompt[:-1])  # one state per call: after its last position
    assert prompt[-1].layers[0].state_norm is not None
    # the state norms change every step (each token writes into the state)
    assert not np.array_equal(trace.steps[-1].layers[0].state_norm, trace.steps[-2].layers[0].state_norm)


def test_the_fused_switch_changes_nothing_the_token_mixing_records(tmp_path):
    """4-bit experts, so the fused MoE pair runs the decode steps: layer 0's mixing reads the embeddings alone and is
    identical; the later layers' only through the MoE blocks' rounding."""
    model, _ = moebench.load(hybrid_folder(tmp_path, "qwen3_next", bits=4))
    traces = {}
    for fused in (True, False):
        stepper = Stepper(model, None, PROMPT, record=True, fused=fused)
        stepper.prefill()
        for token in (11, 12, 13):
            stepper.step(feed=token)
        traces[fused] = stepper.trace
    assert traces[True].steps[-1].layers[0].path.fused and not traces[False].steps[-1].layers[0].path.fused
    for on, off in zip(traces[True].steps, traces[False].steps, strict=True):
        for i in range(4):
            for name in ("decay", "beta", "state_norm", "output_gate"):
                a, b = getattr(on.layers[i], name), getattr(off.layers[i], name)
                assert (a is None) == (b is None), (i, name)
                if a is not None and i == 0:
                    assert np.array_equal(a, b), name
                elif a is not None:
                    assert np.abs(a - b).max() <= TOLERANCE, (i, name)


def test_recording_leaves_the_outputs_as_they_are(hybrid):
    model, _, _ = hybrid
    tokens = mx.array([PROMPT])
    assert np.array_equal(np.array(model(tokens)), np.array(model(tokens, None, Recorder())))
    mixer = model.layers[0].linear_attn
    x = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(0))
    seen = {}

    class Record:
        def __call__(self, name, value):
            seen[name] = value

        def scope(self, child):
            return self

    assert np.array_equal(np.array(mixer(x)), np.array(mixer(x, None, Record())))
    assert sorted(seen) == ["beta", "decay", "output_gate", "state_norm"]
