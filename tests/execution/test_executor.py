"""How a forward call runs: the plan's decisions and their reasons, counted once per step taken, the switch
per model and for every model, and the fused steps against the model's own modules."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.checkpoint.loader import load
from moebench.decode.cache import make_cache
from moebench.decode.loop import generate, generate_tokens
from moebench.errors import ConfigError
from moebench.execution import moe, support
from moebench.execution.executor import executor, fused_moe, fused_moe_enabled, set_fused_moe
from moebench.execution.settings import KernelSettings
from moebench.inspect.record import Recorder
from moebench.models.args import QuantizedParts
from moebench.models.declare import PER_HEAD, AttentionSpec
from moebench.models.layers import ColumnShard
from moebench.models.routing import Intervention
from moebench.models.switch import SwitchGLU
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

PREFILL = "4 tokens (the kernel runs single-token decode)"


@pytest.fixture(autouse=True)
def restore_switch():
    with fused_moe(fused_moe_enabled()):
        yield


def _parts(out_f: int, in_f: int, bits: int, group: int = 64, mode: str = "affine", n_exp: int = 4,
           seed: int = 0) -> QuantizedParts:
    w = mx.array(np.random.default_rng(seed).standard_normal((n_exp, out_f, in_f)).astype(np.float32) * 0.1)
    q, scales, *biases = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    return QuantizedParts(q, scales, biases[0] if biases else None, group, bits, mode)


def _experts(d: int = 128, dff: int = 64, gate=(4, 64), up=(4, 64), down=(4, 64), mode: str = "affine") -> SwitchGLU:
    return SwitchGLU.from_parts(_parts(dff, d, *gate, mode=mode), _parts(dff, d, *up, mode=mode, seed=1),
                                _parts(d, dff, *down, mode=mode, seed=2))


DECLINES = {
    "float experts": lambda: SwitchGLU(128, 64, 4),
    "quantization modes differ ['affine', 'mxfp4']": lambda: SwitchGLU.from_parts(
        _parts(64, 128, 4, 32, "mxfp4"), _parts(64, 128, 4, 32, "mxfp4", seed=1), _parts(128, 64, 4, 64, seed=2)),
    "gate bits 1 not in (2, 3, 4, 5, 6, 8)": lambda: _experts(gate=(1, 64)),
    "down bits 1 not in": lambda: _experts(down=(1, 64)),
    "group sizes differ": lambda: _experts(down=(4, 32)),
}


@pytest.mark.parametrize("reason", sorted(DECLINES))
def test_each_unsupported_layout_declines_with_its_reason(reason):
    experts = DECLINES[reason]()
    for backend in ("reference", "cuda", "metal"):
        assert reason in (support.experts_reason(experts.quantized_parts(), backend) or "")


@pytest.mark.parametrize("mode,group,bits", [("mxfp4", 32, 4), ("nvfp4", 16, 4), ("mxfp8", 32, 8)])
def test_microscaled_experts_run_fused(mode, group, bits):
    experts = _experts(gate=(bits, group), up=(bits, group), down=(bits, group), mode=mode)
    for backend in ("reference", "cuda", "metal"):
        assert support.experts_reason(experts.quantized_parts(), backend) is None


def test_affine_without_biases_declines():
    experts = _experts()
    del experts.down_proj.biases
    assert support.experts_reason(experts.quantized_parts(), "reference") == "down is affine without biases"


@pytest.mark.parametrize("gate,up,down", [(3, 3, 6), (2, 2, 5), (5, 5, 3), (6, 6, 6), (4, 8, 6), (3, 4, 2)])
def test_every_affine_width_runs_fused_gate_up_and_down_each_at_its_own(gate, up, down):
    """2, 3, 4, 5, 6 and 8 bits, as mlx-lm's recipes write them (mixed_3_6: gate and up at 3, down at 3 or 6) and
    with gate and up apart; a 6-bit down at any Dff its group size allows."""
    experts = _experts(dff=96, gate=(gate, 32), up=(up, 32), down=(down, 32))
    for backend in ("reference", "cuda", "metal"):
        assert support.experts_reason(experts.quantized_parts(), backend) is None


def test_dff_above_the_gpu_cap_declines():
    experts = _experts(dff=128)
    parts = experts.quantized_parts()
    assert support.experts_reason(parts, "cuda") is None and support.experts_reason(parts, "metal") is None
    assert "Dff 128 above the cuda cap 64" in support.experts_reason(parts, "cuda", max_dff=64)
    assert support.experts_reason(parts, "reference", max_dff=64) is None  # the CPU reference has no cap


def test_fused_and_fallback_routed_experts_agree_in_float32():
    experts = _experts()
    x = mx.array(np.random.default_rng(3).standard_normal((1, 128)).astype(np.float32))
    idx, sc = mx.array([[3, 1]], dtype=mx.uint32), mx.array([[0.7, 0.3]])
    fused_out, fused_y = moe.routed_experts("reference", experts, x, idx, sc)
    fb_out, fb_y = moe.routed_experts("fallback", experts, x, idx, sc)
    assert fused_y.dtype == mx.float32 and fused_y.shape == (1, 2, 128)
    assert np.allclose(np.array(fused_y), np.array(fb_y), rtol=1e-4, atol=1e-5)
    assert np.allclose(np.array(fused_out), np.array(fb_out), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = qwen2_moe_config(num_hidden_layers=3, mlp_only_layers=[1])
    return write_random_checkpoint(tmp_path_factory.mktemp("fused") / "ckpt", cfg, seed=5, bits=4)


@pytest.fixture
def model(folder):
    return load(folder)[0]


def test_decode_steps_run_fused_and_prefill_falls_back_with_the_reason(model):
    assert sorted(model.moe_blocks()) == [0, 2]
    result = generate(model, [5, 6, 7, 8], max_tokens=9)
    assert len(result.token_ids) == 9
    counts = moebench.dispatch(model)
    for part in ("moe", "attention"):
        for d in counts[part].values():  # 8 single-token decode steps after the prefill
            assert d["fused"] == {"reference": 8} and d["reasons"] == {PREFILL: 1} and d["fallback"] == 1, d
    assert sorted(counts["moe"]) == [0, 2] and sorted(counts["attention"]) == [0, 1, 2]


def test_steps_queued_and_never_taken_are_not_counted(model):
    steps = generate_tokens(model, [5, 6, 7, 8], max_tokens=20)
    for _ in range(3):
        next(steps)
    steps.close()  # two more steps were built ahead and are dropped
    assert moebench.dispatch(model)["moe"][0]["fused"] == {"reference": 2}


def test_the_compiled_step_runs_the_same_plan_and_counts_the_same(model):
    eager = generate(model, [5, 6, 7, 8], 8, compiled=False)
    counts = executor(model).summary()
    executor(model).reset_counts()
    compiled = generate(model, [5, 6, 7, 8], 8, compiled=True)
    assert compiled.token_ids == eager.token_ids
    assert executor(model).summary() == counts


def test_a_plan_is_decided_once_per_settings_and_shape(model):
    ex = executor(model)
    cache = make_cache(len(model.layers))
    first = ex.plan(1, cache)
    assert ex.plan(1, cache) is first
    off = ex.plan(1, cache, KernelSettings(fused=False))
    assert off is not first and all(not lp.attention.fused and "switched off" in lp.attention.reason
                                    for lp in off.layers)
    assert [lp.moe is None for lp in first.layers] == [False, True, False]  # layer 1 is a dense MLP
    assert ex.plan(3, cache).layers[0].moe.reason == "3 tokens (the kernel runs single-token decode)"


def test_the_switch_per_model_and_for_every_model(model, folder):
    other = load(folder)[0]
    set_fused_moe("off", model)
    assert not fused_moe_enabled(model) and fused_moe_enabled(other)
    with fused_moe(True, model):
        assert fused_moe_enabled(model)
    assert not fused_moe_enabled(model)
    with fused_moe(False):
        assert not fused_moe_enabled(other) and not fused_moe_enabled()
        assert not fused_moe_enabled(load(folder)[0])  # a model opened meanwhile follows the switch
    assert fused_moe_enabled(other) and not fused_moe_enabled(model)
    generate(model, [5, 6, 7, 8], 4)
    assert moebench.dispatch(model)["moe"][0]["reasons"] == {PREFILL: 1, "switched off (MOEBENCH_FUSED_MOE / "
                                                                      "set_fused_moe)": 3}


@pytest.mark.parametrize("value", ["disabled", 1, None])
def test_the_switch_refuses_values_it_does_not_understand(model, value):
    with pytest.raises(ConfigError, match="expected True or False"):
        set_fused_moe(value)
    with pytest.raises(ConfigError, match="expected True or False"):
        set_fused_moe(value, model)


def test_the_attention_kernel_can_be_kept_off_alone(model):
    executor(model).settings = KernelSettings(attention_kernel=False)
    generate(model, [5, 6, 7, 8], 4)
    counts = moebench.dispatch(model)
    assert counts["moe"][0]["fused"] == {"reference": 3}
    assert "attention kernel switched off" in " ".join(counts["attention"][0]["reasons"])


def _block_step(model, layer: int, residual: mx.array, fused: bool) -> np.ndarray:
    """residual + the MoE block of `layer` on its normed input, through the plan's fused step or the modules."""
    plan = executor(model).plan(1, make_cache(len(model.layers)), KernelSettings(fused=fused))
    step, norm = plan.layers[layer].moe_step, model.layers[layer].post_attention_layernorm
    block = model.layers[layer].mlp
    return np.array(step(norm, residual, None) if fused else residual + block(norm(residual))), \
        plan.layers[layer].moe


def test_fused_block_with_the_shared_expert_and_residual_inside_matches_the_fallback(model):
    rng = np.random.default_rng(12)
    residual = mx.array(rng.standard_normal((1, 1, 128)).astype(np.float32))
    fused, decision = _block_step(model, 0, residual, True)
    fallback, _ = _block_step(model, 0, residual, False)
    assert decision.path == "reference" and decision.note is None and fused.shape == (1, 1, 128)
    assert np.allclose(fused, fallback, rtol=1e-4, atol=1e-4)


def test_a_shared_expert_stored_unlike_the_routed_ones_runs_beside_the_kernels_and_says_why(model):
    down = model.layers[2].mlp.shared_expert.down_proj
    dense = mx.dequantize(down.weight, down.scales, down.biases, group_size=64, bits=4)
    q, s, b = mx.quantize(dense, group_size=64, bits=8)
    down.set_weight(q, QuantizedParts(q, s, b, 64, 8, "affine"))
    executor(model).refresh()  # weights replaced: the plans are decided again
    x = mx.array(np.random.default_rng(13).standard_normal((1, 1, 128)).astype(np.float32))
    fused, decision = _block_step(model, 2, x, True)
    fallback, _ = _block_step(model, 2, x, False)
    assert np.allclose(fused, fallback, rtol=1e-4, atol=1e-4)
    assert decision.path == "reference" and decision.note == (
        "shared expert beside the kernels: its down_proj is 8-bit g64 affine (float32 scales), the routed experts' "
        "4-bit g64 affine (float32 scales)")
    recorder = Recorder()
    executor(model).forward(mx.array([[5]]), make_cache(len(model.layers)),
                            executor(model).plan(1, make_cache(len(model.layers))), recorder)
    assert recorder.values["layers.2.moe.path"] == decision and recorder.values["layers.0.moe.path"].note is None


def test_one_kernel_normalises_and_computes_the_router_logits_unless_it_cannot_read_the_router(model):
    """Quantized rows: the norm and the router's logits run in one kernel before the kernel pair (one launch where
    there were two), the block's output the fallback's. A float router: the norm and its matmul run as their own
    launches, the layer's note says why, the output is unchanged."""
    plan = executor(model).plan(1, make_cache(len(model.layers)))
    assert plan.layers[0].moe_step.router_note is None and plan.layers[0].moe.note is None
    names = plan.layers[0].launches.names
    assert names[names.index("post-attention norm + router logits (kernel)") + 1] == "router + gate/up (kernel)"
    assert "post-attention norm (rms_norm)" not in names
    residual = mx.array(np.random.default_rng(14).standard_normal((1, 1, 128)).astype(np.float32))
    quantized, _ = _block_step(model, 0, residual, True)
    gate = model.layers[0].mlp.gate
    gate.set_weight(mx.dequantize(gate["weight"], gate["scales"], gate["biases"], group_size=gate.group_size,
                                  bits=gate.bits))
    executor(model).refresh()  # weights replaced: the plans are decided again
    fused, decision = _block_step(model, 0, residual, True)
    fallback, _ = _block_step(model, 0, residual, False)
    assert decision.fused and decision.note == ("the norm and the router's matmul as their own launches: the router "
                                                "is float (the kernel reads quantized rows)")
    assert np.allclose(fused, fallback, rtol=1e-4, atol=1e-4) and np.allclose(quantized, fused, rtol=1e-2, atol=1e-2)


def test_the_rows_kernel_declines_a_norm_a_linear_or_dtypes_it_does_not_read(model):
    block_norm, router = model.layers[0].post_attention_layernorm, model.layers[0].mlp.gate
    assert support.rows_reason("the router", router, mx.float32, 8, block_norm) is None
    assert support.rows_reason("the router", router, mx.float32, 8, router) == \
        "the norm before the router is a Linear, not an RMSNorm"
    assert support.rows_reason("the router", router, mx.bfloat16, 8, block_norm) == \
        "the norm before the router has a mlx.core.float32 weight, the activations are mlx.core.bfloat16"
    o_proj = model.layers[0].self_attn.o_proj
    assert support.rows_reason("o_proj", o_proj, mx.float32, 8) is None
    assert support.rows_reason("o_proj", model.layers[0].mlp.switch_mlp.gate_proj, mx.float32, 8) == \
        "o_proj is a SwitchLinear, not a Linear"
    shard = ColumnShard(64, 0, 64, 128, group=None)
    assert support.rows_reason("o_proj", shard, mx.float32, 8) == \
        "o_proj sharded over ranks (its partial sums joined by all_sum)"
    assert support.norm_memory_reason(8184, 8) is None
    assert support.norm_memory_reason(8192, 8) == \
        "8192 inputs take 32800 bytes of threadgroup memory (a threadgroup holds 32768)"


def test_one_kernel_computes_o_proj_and_adds_the_residual_unless_it_cannot_read_o_proj(model):
    """A quantized o_proj: it and the residual add run in one kernel after the attention kernel, and the layer's
    attention output is the fallback's. A float o_proj: it and the add run as their own launches, the layer's note
    says why, the output is unchanged."""
    residual = mx.array(np.random.default_rng(15).standard_normal((1, 1, 128)).astype(np.float32))
    norm, attn = model.layers[0].input_layernorm, model.layers[0].self_attn

    def layer_attention(fused: bool):
        plan = executor(model).plan(1, make_cache(len(model.layers)), KernelSettings(fused=fused))
        return plan, np.array(plan.layers[0].attend(attn, norm, residual, make_cache(len(model.layers))[0]))

    plan, fused = layer_attention(True)
    step = plan.layers[0].attention_step
    assert step.o_note is None and plan.layers[0].attention.note is None
    names = plan.layers[0].launches.names
    assert "o_proj + residual (kernel)" in names
    assert "o_proj (quantized matmul)" not in names and "residual (add)" not in names
    _, fallback = layer_attention(False)
    assert np.allclose(fused, fallback, rtol=1e-4, atol=1e-4)
    o_proj = attn.o_proj
    o_proj.set_weight(mx.dequantize(o_proj["weight"], o_proj["scales"], o_proj["biases"], group_size=o_proj.group_size,
                                    bits=o_proj.bits))
    executor(model).refresh()
    plan, float_o = layer_attention(True)
    assert plan.layers[0].attention.note == ("o_proj and the residual add as their own launches: o_proj is float (the "
                                             "kernel reads quantized rows)")
    launches = plan.layers[0].launches  # a float x @ W^T: not declared
    assert launches.names is None and "o_proj not a quantized Linear" in launches.reason
    assert np.allclose(float_o, layer_attention(False)[1], rtol=1e-4, atol=1e-4)


def test_an_intervention_keeps_the_kernels_and_notes_that_routing_left_the_router_kernel(model):
    block = model.moe_blocks()[0]
    block.intervention = Intervention(ablate=(0,))
    try:
        plan = executor(model).plan(1, make_cache(len(model.layers)))
    finally:
        block.intervention = None
    assert plan.layers[0].moe.fused and "routing by moebench.models.routing.route" in plan.layers[0].moe.note
    assert plan.layers[2].moe.note is None


def test_a_model_that_decoded_is_freed_when_dropped(folder):
    import weakref

    model = load(folder)[0]
    generate(model, [5, 6, 7, 8], 4)
    dropped = weakref.ref(model)
    del model
    assert dropped() is None  # no reference cycle keeps its weights alive until the cycle collector runs


def test_a_long_prompt_runs_in_chunks_with_the_same_tokens_and_less_memory(folder, monkeypatch):
    """Past PREFILL_CHUNK tokens the prompt runs a chunk at a time (as mlx-lm prefills), eager and compiled: the
    same greedy tokens as one pass over the whole prompt, in less peak memory."""
    import gc

    from moebench.execution import executor as executor_module

    model = load(folder)[0]
    prompt = np.random.default_rng(3).integers(0, model.args.vocab_size, 1200).tolist()

    def run(chunk: int, compiled: bool) -> tuple[list[int], int]:
        monkeypatch.setattr(executor_module, "PREFILL_CHUNK", chunk)
        monkeypatch.setattr("moebench.decode.compiled.PREFILL_CHUNK", chunk)
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        tokens = generate(model, prompt, 3, compiled=compiled).token_ids
        return tokens, mx.get_peak_memory()

    whole, whole_peak = run(10**6, False)
    for compiled in (False, True):
        chunked, peak = run(300, compiled)
        assert chunked == whole
        assert peak < 0.8 * whole_peak, f"compiled={compiled}: {peak / 1e6:.0f} MB against {whole_peak / 1e6:.0f} MB"


@pytest.mark.parametrize("words,reason", [(dict(rope_fraction=0.375), "rotary on 24 of 64 dims"),
                                          (dict(clip_qkv=8.0, qk_norm=PER_HEAD), "after the per-head norm"),
                                          (dict(window=0), "a sliding window of 0 positions")])
def test_attention_the_kernel_does_not_compute_declines_by_its_declaration(words, reason):
    """A declaration the decode-attention kernel does not compute is declined with its words, whatever else holds."""
    assert support.attention_reason(AttentionSpec(8, 2, 64)) is None
    assert reason in support.attention_reason(AttentionSpec(8, 2, 64, **words))
