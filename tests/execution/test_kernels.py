"""Fused-or-fallback dispatch: the switch, every decline reason, the per-layer counters over a real
decode, and greedy decoding with the switch on vs off."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from moebench.checkpoint.loader import load
from moebench.checkpoint.quant import QuantizedParts
from moebench.decode.loop import generate, generate_tokens
from moebench.execution import dispatch as kernels
from moebench.models.layers import Linear
from moebench.models.switch import SwitchGLU, SwitchLinear
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint


@pytest.fixture(autouse=True)
def restore_switch():
    with kernels.fused_moe(kernels.fused_moe_enabled()):
        yield


@pytest.mark.parametrize("raw", ["0", "false", " OFF ", "No", "FALSE\n"])
def test_env_words_switch_the_fused_path_off(monkeypatch, raw):
    monkeypatch.setenv(kernels.ENV_SWITCH, raw)
    assert kernels._env_switch() is False


@pytest.mark.parametrize("raw", [None, "", "1", "on", "yes", "true", "nope"])
def test_anything_else_leaves_it_on(monkeypatch, raw):
    if raw is None:
        monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(kernels.ENV_SWITCH, raw)
    assert kernels._env_switch() is True


def test_setter_and_context_manager():
    kernels.set_fused_moe(True)
    with kernels.fused_moe(False):
        assert not kernels.fused_moe_enabled()
        with kernels.fused_moe(True):
            assert kernels.fused_moe_enabled()
        assert not kernels.fused_moe_enabled()
    assert kernels.fused_moe_enabled()


def _linear(out_f: int, in_f: int, bits: int | None, group: int = 64, mode: str = "affine", n_exp: int = 4,
            seed: int = 0) -> SwitchLinear:
    w = mx.array(np.random.default_rng(seed).standard_normal((n_exp, out_f, in_f)).astype(np.float32) * 0.1)
    if bits is None:
        return SwitchLinear(w)
    q, scales, *biases = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    return SwitchLinear(q, QuantizedParts(q, scales, biases[0] if biases else None, group, bits, mode))


def _experts(d: int = 128, dff: int = 64, gate=(4, 64), up=(4, 64), down=(4, 64), mode: str = "affine") -> SwitchGLU:
    return SwitchGLU(_linear(dff, d, *gate, mode=mode), _linear(dff, d, *up, mode=mode, seed=1),
                     _linear(d, dff, *down, mode=mode, seed=2))


DECLINES = {
    "float experts": lambda: SwitchGLU(_linear(64, 128, None), _linear(64, 128, None), _linear(128, 64, None)),
    "quantization mode": lambda: _experts(gate=(4, 32), up=(4, 32), down=(4, 32), mode="mxfp4"),
    "gate bits 4 != up bits 8": lambda: _experts(up=(8, 64)),
    "gate/up bits 3 not in": lambda: _experts(gate=(3, 64), up=(3, 64)),
    "gate/up bits 2 not in": lambda: _experts(gate=(2, 64), up=(2, 64)),
    "down bits 3 not in": lambda: _experts(down=(3, 64)),
    "group sizes differ": lambda: _experts(down=(4, 32)),
}


@pytest.mark.parametrize("reason", sorted(DECLINES))
def test_each_unsupported_layout_declines_with_its_reason(reason):
    experts = DECLINES[reason]()
    for backend in ("reference", "cuda", "metal"):
        assert reason in (kernels.support_reason(experts, backend) or "")
    counter = kernels.DispatchCounter()
    x = mx.zeros((1, 128))
    out, y, decision = kernels.routed_experts(experts, x, mx.array([[0, 1]], dtype=mx.uint32), mx.array([[0.5, 0.5]]),
                                              counter)
    assert not decision.fused and reason in decision.reason
    assert counter.fallback == 1 and not counter.fused and y.shape == (1, 2, 128) and out.shape == (1, 128)


def test_affine_without_biases_declines():
    experts = _experts()
    del experts.down_proj.biases
    assert kernels.support_reason(experts, "reference") == "affine without biases"


def test_six_bit_down_needs_dff_divisible_by_16():
    """MLX group sizes keep real Dff a multiple of 32; a gate of 40 rows stands in for a shape the
    6-bit byte addressing could not handle."""
    experts = SwitchGLU(_linear(40, 128, 4), _linear(40, 128, 4, seed=1), _linear(128, 64, 6, seed=2))
    assert kernels.support_reason(experts, "cuda") == "6-bit down needs Dff % 16 == 0 (Dff 40)"
    assert kernels.support_reason(_experts(down=(6, 64)), "cuda") is None


def test_dff_above_the_gpu_cap_declines(monkeypatch):
    experts = _experts(dff=128)
    monkeypatch.delenv(kernels.ENV_MAX_DFF, raising=False)
    assert kernels.max_dff("metal") == 4096 and kernels.max_dff("cuda") == 8192 and kernels.max_dff("reference") is None
    monkeypatch.setenv(kernels.ENV_MAX_DFF, "64")
    assert "Dff 128 above the cuda cap 64" in kernels.support_reason(experts, "cuda")
    assert kernels.support_reason(experts, "reference") is None  # the CPU reference has no cap
    for bad in ("0", "-5", "big"):
        monkeypatch.setenv(kernels.ENV_MAX_DFF, bad)
        assert kernels.max_dff("cuda") == 8192


def test_switched_off_and_multi_token_steps_fall_back_with_reasons():
    experts, counter = _experts(), kernels.DispatchCounter()
    idx, sc = mx.array([[0, 1]], dtype=mx.uint32), mx.array([[0.5, 0.5]])
    with kernels.fused_moe(False):
        assert "switched off" in counter.decide(experts, 1).reason
    assert counter.decide(experts, 3).reason == "3 tokens (the kernel runs single-token decode)"
    assert counter.decide(experts, 1).path == "reference"
    _, _, decision = kernels.routed_experts(experts, mx.zeros((2, 128)), mx.concatenate([idx, idx]),
                                            mx.concatenate([sc, sc]), counter)
    assert not decision.fused
    assert counter.as_dict()["fused"] == {"reference": 1} and counter.fallback == 3


def test_fused_and_fallback_agree_in_float32():
    experts, counter = _experts(), kernels.DispatchCounter()
    x = mx.array(np.random.default_rng(3).standard_normal((1, 128)).astype(np.float32))
    idx, sc = mx.array([[3, 1]], dtype=mx.uint32), mx.array([[0.7, 0.3]])
    fused_out, fused_y, decision = kernels.routed_experts(experts, x, idx, sc, counter)
    with kernels.fused_moe(False):
        fb_out, fb_y, _ = kernels.routed_experts(experts, x, idx, sc, counter)
    assert decision.path == "reference" and fused_y.dtype == mx.float32
    assert np.allclose(np.array(fused_y), np.array(fb_y), rtol=1e-4, atol=1e-5)
    assert np.allclose(np.array(fused_out), np.array(fb_out), rtol=1e-4, atol=1e-5)


def test_cached_parts_follow_replaced_weights():
    experts, counter = _experts(), kernels.DispatchCounter()
    first = counter.quantized_parts(experts)
    assert counter.quantized_parts(experts) is first
    experts.down_proj.scales = experts.down_proj.scales * 2
    again = counter.quantized_parts(experts)
    assert again is not first and again[2].scales is experts.down_proj.scales


@pytest.fixture(scope="module")
def quantized_model(tmp_path_factory):
    cfg = qwen2_moe_config(num_hidden_layers=3, mlp_only_layers=[1])
    folder = write_random_checkpoint(tmp_path_factory.mktemp("fused") / "ckpt", cfg, seed=5, bits=4)
    return load(folder)[0]


def test_counters_prove_fused_on_every_decode_step_and_never_in_prefill(quantized_model):
    blocks = quantized_model.moe_blocks()
    assert sorted(blocks) == [0, 2]
    for block in blocks.values():
        block.dispatch.reset()
    with kernels.fused_moe(True):
        result = generate(quantized_model, [5, 6, 7, 8], max_tokens=9)
    assert len(result.token_ids) == 9
    for block in blocks.values():
        d = block.dispatch.as_dict()
        assert d["fused"] == {"reference": 8}, d  # 8 single-token decode steps after the prefill
        assert d["fallback"] == 1 and d["reasons"] == {"4 tokens (the kernel runs single-token decode)": 1}


def test_greedy_decode_with_the_switch_on_and_off(quantized_model):
    """Identical greedy tokens, or the first divergence is a near-tie of the fallback's top two logits."""
    prompt, steps = [10, 20, 30], 24
    runs = {}
    for on in (True, False):
        with kernels.fused_moe(on):
            runs[on] = [(tok, np.array(logits)) for tok, logits in generate_tokens(quantized_model, prompt, steps)]
    tokens_on, tokens_off = [t for t, _ in runs[True]], [t for t, _ in runs[False]]
    if tokens_on == tokens_off:
        return
    step = next(i for i, (a, b) in enumerate(zip(tokens_on, tokens_off, strict=True)) if a != b)
    top2 = np.sort(runs[False][step][1])[-2:]
    margin = float(top2[1] - top2[0])
    assert margin < 1e-3, f"tokens diverge at step {step} with top-1 margin {margin:.3e}: not a near-tie"


def _block_outputs(block, x: mx.array, residual: mx.array) -> dict[str, np.ndarray]:
    """The block's output plus the residual, fused and fallback, and the fused path's decision."""
    out = {}
    for on in (True, False):
        with kernels.fused_moe(on):
            out[on] = np.array(block(x, residual=residual))
    return out


def test_fused_block_with_shared_expert_and_residual_matches_the_fallback(quantized_model):
    block = quantized_model.moe_blocks()[0]
    rng = np.random.default_rng(12)
    x = mx.array(rng.standard_normal((1, 1, 128)).astype(np.float32))
    residual = mx.array(rng.standard_normal((1, 1, 128)).astype(np.float32))
    out = _block_outputs(block, x, residual)
    assert block.dispatch.last.path == "fallback" and block.dispatch.notes == []
    assert out[True].shape == (1, 1, 128)
    assert np.allclose(out[True], out[False], rtol=1e-4, atol=1e-4)
    with kernels.fused_moe(True):
        without = np.array(block(x))
    assert np.allclose(without + np.array(residual), out[True], rtol=1e-5, atol=1e-5)


def test_shared_expert_stored_unlike_the_routed_ones_runs_beside_the_kernels_and_says_why(quantized_model):
    block = quantized_model.moe_blocks()[2]
    down = block.shared_expert.down_proj
    dense = mx.dequantize(down.weight, down.scales, down.biases, group_size=64, bits=4)
    q, s, b = mx.quantize(dense, group_size=64, bits=8)
    eight_bit = Linear(q, parts=QuantizedParts(q, s, b, 64, 8, "affine"))
    block.shared_expert.down_proj = eight_bit
    try:
        x = mx.array(np.random.default_rng(13).standard_normal((1, 1, 128)).astype(np.float32))
        out = _block_outputs(block, x, mx.zeros_like(x))
        assert np.allclose(out[True], out[False], rtol=1e-4, atol=1e-4)
        with kernels.fused_moe(True):
            block(x)
        assert block.dispatch.last.path == "reference"
        assert block.dispatch.notes == ["shared expert beside the kernels: its down_proj is 8-bit g64 affine "
                                        "(float32 scales), the routed experts' 4-bit g64 affine (float32 scales)"]
        recorded = {}
        with kernels.fused_moe(True):
            block(x, layer=2, record=lambda name, value: recorded.__setitem__(name, value))
        path = recorded["layers.2.moe.path"]
        assert path.fused and path.note == block.dispatch.notes[0]
    finally:
        block.shared_expert.down_proj = down
    with kernels.fused_moe(True):
        block(x)
    assert block.dispatch.notes == []
