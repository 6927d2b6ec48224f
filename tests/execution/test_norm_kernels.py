"""The kernels that fold a norm into what follows it (the MoE block's entry: residual add, post-attention
RMSNorm, router rows and selection; the input-norm q/k/v projection): their references against the
unfused operations, the checks that stand between a bad launch and the process, and the model running
them at every fused decode step, or saying why not."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.checkpoint.quant import QuantizedParts
from moebench.decode.loop import generate
from moebench.errors import UnsupportedKernelConfig
from moebench.execution import norms as norm_kernels
from moebench.execution.moe import reference_select
from moebench.execution.norms import norm_matvec, norm_router, projection_reason, support_reason
from moebench.inspect.record import Stepper

D = 128


def _router(rows: int, bits: int = 8, group: int = 64, seed: int = 0, dtype: mx.Dtype = mx.float32) -> QuantizedParts:
    w = mx.random.normal((rows, D), key=mx.random.key(seed)) / np.sqrt(D)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return QuantizedParts(q, s.astype(dtype), b.astype(dtype), group, bits, "affine")


def _token(seed: int, dtype: mx.Dtype = mx.float32) -> tuple[mx.array, mx.array, mx.array]:
    k = mx.random.split(mx.random.key(seed), 3)
    return (4 * mx.random.normal((1, 1, D), key=k[0])).astype(dtype), mx.random.normal((1, 1, D), key=k[1]).astype(
        dtype), mx.random.uniform(0.5, 1.5, (D,), key=k[2]).astype(dtype)


@pytest.mark.parametrize("n_exp,top_k,norm,gate_row,bits", [(8, 2, False, True, 8), (16, 4, True, False, 4),
                                                            (60, 4, False, True, 6)])
def test_reference_matches_the_unfused_operations(n_exp, top_k, norm, gate_row, bits):
    resid, attn, norm_w = _token(n_exp)
    router = _router(n_exp + gate_row, bits, seed=n_exp)
    h, xn, logits, probs, inds, scores, sgate = norm_router("reference", resid, attn, norm_w, 1e-6, router, n_exp,
                                                            top_k, norm, gate_row)
    want_h = resid + attn
    want_xn = mx.fast.rms_norm(want_h, norm_w, 1e-6)
    dense = mx.dequantize(router.weight, router.scales, router.biases, group_size=router.group_size, bits=bits)
    want_logits = want_xn @ dense.T
    assert np.array_equal(np.array(h), np.array(want_h))
    assert np.abs(np.array(xn) - np.array(want_xn)).max() < 1e-5
    assert logits.shape == (1, 1, n_exp + gate_row) and logits.dtype == mx.float32
    assert np.abs(np.array(logits) - np.array(want_logits)).max() < 1e-4
    for got, want in zip((probs, inds, scores, sgate), reference_select(logits, n_exp, top_k, norm, gate_row),
                         strict=True):
        assert got.shape == want.shape and np.array_equal(np.array(got), np.array(want))


def test_bfloat16_rounds_the_residual_and_the_normed_token_as_mlx_does():
    """h as an add in bfloat16 rounds; the normed token as mx.fast.rms_norm rounds (the normalised value, then
    its product with the weight), so the fused path and the unfused one start kernel A from the same token."""
    resid, attn, norm_w = _token(3, mx.bfloat16)
    h, xn, *_ = norm_router("reference", resid, attn, norm_w, 1e-6, _router(9, dtype=mx.bfloat16), 8, 2, False, True)
    assert h.dtype == xn.dtype == mx.bfloat16
    assert np.array_equal(np.array(h.astype(mx.float32)), np.array((resid + attn).astype(mx.float32)))
    want = mx.fast.rms_norm(resid + attn, norm_w, 1e-6)
    assert np.array_equal(np.array(xn.astype(mx.float32)), np.array(want.astype(mx.float32)))


def test_support_reasons_name_what_the_kernel_cannot_read():
    f32 = mx.float32
    assert support_reason(_router(9), False, f32, f32) is None
    assert "float" in support_reason(None, False, f32, f32)
    assert "2-bit" in support_reason(_router(9, bits=2), False, f32, f32)
    assert "without biases" in support_reason(replace(_router(9), biases=None), False, f32, f32)
    assert "bias" in support_reason(_router(9), True, f32, f32)
    assert "bfloat16" in support_reason(_router(9), False, mx.bfloat16, f32)


def test_bad_inputs_are_named_before_any_launch():
    resid, attn, norm_w = _token(1)
    router = _router(9)
    with pytest.raises(UnsupportedKernelConfig, match="expected one token"):
        norm_router("reference", mx.concatenate([resid, resid], axis=1), attn, norm_w, 1e-6, router, 8, 2, False,
                    True)
    with pytest.raises(UnsupportedKernelConfig, match="attention output"):
        norm_router("reference", resid, attn[..., :64], norm_w, 1e-6, router, 8, 2, False, True)
    with pytest.raises(UnsupportedKernelConfig, match="expected 8 rows"):
        norm_router("reference", resid, attn, norm_w, 1e-6, router, 8, 2, False, False)
    with pytest.raises(UnsupportedKernelConfig, match="top-9 of 8"):
        norm_router("reference", resid, attn, norm_w, 1e-6, router, 8, 9, False, True)
    with pytest.raises(UnsupportedKernelConfig, match="unknown fused backend"):
        norm_router("vulkan", resid, attn, norm_w, 1e-6, router, 8, 2, False, True)


@pytest.mark.parametrize("bits,rows", [(4, 24), (8, 40)])
def test_projection_reference_matches_norm_then_quantized_matmul(bits, rows):
    x, _, norm_w = _token(bits)
    parts = _router(rows, bits, seed=rows)
    got = norm_matvec("reference", x, norm_w, 1e-6, parts)
    want = mx.quantized_matmul(mx.fast.rms_norm(x, norm_w, 1e-6), parts.weight, parts.scales, parts.biases,
                               group_size=parts.group_size, bits=bits)
    assert got.shape == (1, 1, rows) and got.dtype == x.dtype
    assert np.abs(np.array(got) - np.array(want)).max() < 1e-4


def test_projection_declines_and_rejects_with_names():
    f32 = mx.float32
    assert projection_reason(_router(8, bits=4), f32, f32) is None
    assert "6-bit" in projection_reason(_router(8, bits=6), f32, f32)
    assert "float" in projection_reason(None, f32, f32)
    x, _, norm_w = _token(2)
    with pytest.raises(UnsupportedKernelConfig, match="expected one token"):
        norm_matvec("reference", mx.concatenate([x, x], axis=1), norm_w, 1e-6, _router(8))
    with pytest.raises(UnsupportedKernelConfig, match="norm weight"):
        norm_matvec("reference", x, norm_w[:64], 1e-6, _router(8))
    with pytest.raises(UnsupportedKernelConfig, match="unknown fused backend"):
        norm_matvec("vulkan", x, norm_w, 1e-6, _router(8))


def _spy(monkeypatch, name: str) -> list[str]:
    """The backends of every call to norm_kernels.`name` from here on."""
    calls: list[str] = []
    real = getattr(norm_kernels, name)

    def spy(backend, *args):
        calls.append(backend)
        return real(backend, *args)

    monkeypatch.setattr(norm_kernels, name, spy)
    return calls


def _count_entries(monkeypatch) -> list[str]:
    return _spy(monkeypatch, "norm_router")


@pytest.fixture
def switched_on(monkeypatch) -> None:
    monkeypatch.setenv(norm_kernels.ENV_SWITCH, "1")


def test_off_by_default_the_layers_run_the_mlx_operations(quantized_checkpoint, monkeypatch):
    monkeypatch.delenv(norm_kernels.ENV_SWITCH, raising=False)
    model, _ = moebench.load(quantized_checkpoint)
    calls = _count_entries(monkeypatch) + _spy(monkeypatch, "norm_matvec")
    with moebench.fused_moe(True):
        generate(model, [3, 1, 4], 4, compiled=False)
    assert calls == [] and not norm_kernels.enabled()
    for counter in model.dispatch_counters():
        assert sum(counter.fused.values()) == 3 and counter.notes == []  # the other kernels ran every step


def test_every_fused_decode_step_runs_both_norm_kernels_in_every_layer(quantized_checkpoint, monkeypatch,
                                                                        switched_on):
    model, _ = moebench.load(quantized_checkpoint)
    calls, projections = _count_entries(monkeypatch), _spy(monkeypatch, "norm_matvec")
    with moebench.fused_moe(True):
        fused = generate(model, [3, 1, 4, 1, 5], 8, compiled=False).token_ids
    assert calls == ["reference"] * (7 * len(model.moe_blocks()))  # decode steps only: the prefill has 5 tokens
    assert projections == ["reference"] * (7 * len(model.layers))
    assert all(not c.notes for c in model.dispatch_counters())
    with moebench.fused_moe(False):
        fallback = generate(model, [3, 1, 4, 1, 5], 8, compiled=False).token_ids
    assert len(calls) == 7 * len(model.moe_blocks())  # switched off: never entered
    assert fused == fallback  # float32: the entry's float32 router logits change no greedy choice here


def test_a_router_the_kernel_cannot_read_runs_beside_it_and_says_why(quantized_checkpoint, monkeypatch,
                                                                     switched_on):
    model, _ = moebench.load(quantized_checkpoint)
    calls = _count_entries(monkeypatch)
    monkeypatch.setattr(norm_kernels, "support_reason", lambda *a: "the router's rows are float (test)")
    with moebench.fused_moe(True):
        generate(model, [3, 1, 4], 4, compiled=False)
    assert calls == []
    for block in model.moe_blocks().values():
        assert sum(block.dispatch.fused.values()) == 3  # the kernel pair still ran every decode step
        assert block.dispatch.notes == ["router and post-attention norm beside the kernels: the router's rows are "
                                        "float (test)"]


def test_a_projection_the_kernel_cannot_read_runs_beside_it_and_says_why(quantized_checkpoint, monkeypatch,
                                                                         switched_on):
    model, _ = moebench.load(quantized_checkpoint)
    projections = _spy(monkeypatch, "norm_matvec")
    monkeypatch.setattr(norm_kernels, "projection_reason", lambda *a: "the q/k/v projection is float (test)")
    with moebench.fused_moe(True):
        generate(model, [3, 1, 4], 4, compiled=False)
    assert projections == []
    for layer in model.layers:
        assert sum(layer.self_attn.dispatch.fused.values()) == 3  # the attention kernel still ran every step
        assert layer.self_attn.dispatch.notes == ["input norm and q/k/v projection beside the kernel: the q/k/v "
                                                  "projection is float (test)"]


def test_recording_with_the_norm_kernels_on_changes_nothing_and_records_their_outputs(quantized_checkpoint,
                                                                                      monkeypatch, switched_on):
    """The recorded step runs the same launches: same tokens and logits as unrecorded, and the recorded router
    logits, probabilities and choices are the entry kernel's."""
    model, _ = moebench.load(quantized_checkpoint)
    calls = _count_entries(monkeypatch)
    with moebench.fused_moe(True):
        plain = Stepper(model, None, [3, 1, 4, 1, 5], keep_logits=True).run(6)
        recorded = Stepper(model, None, [3, 1, 4, 1, 5], keep_logits=True, record=True).run(6)
    assert len(calls) == 2 * 5 * len(model.moe_blocks())  # 6 tokens: the prefill gives one, 5 decode steps
    assert recorded.token_ids == plain.token_ids
    assert np.array_equal(np.stack([s.logits for s in recorded.steps]), np.stack([s.logits for s in plain.steps]))
    k = model.args.num_experts_per_tok
    for step in (s for s in recorded.steps if s.phase == "decode"):
        for r in step.layers.values():
            assert r.path.path == "reference" and r.router_logits.shape == (model.args.num_experts,)
            probs = np.exp(r.router_logits - r.router_logits.max())
            np.testing.assert_allclose(r.router_probs, probs / probs.sum(), rtol=1e-5, atol=1e-7)
            assert list(r.topk_ids.reshape(-1)) == list(np.argsort(-r.router_probs.reshape(-1))[:k])


def test_the_compiled_step_traces_the_norm_kernels_and_decodes_what_the_eager_one_does(quantized_checkpoint,
                                                                                       monkeypatch, switched_on):
    model, _ = moebench.load(quantized_checkpoint)
    calls = _count_entries(monkeypatch)
    with moebench.fused_moe(True):
        eager = generate(model, [3, 1, 4, 1, 5], 8, compiled=False).token_ids
        traced = len(calls)
        compiled = generate(model, [3, 1, 4, 1, 5], 8, compiled=True).token_ids
    assert compiled == eager
    # the compiled step called the kernel only while tracing (once per MoE block), then replayed the graph
    assert len(calls) - traced == len(model.moe_blocks())
