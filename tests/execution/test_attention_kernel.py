"""The decode-attention step: its reference against MLX's own attention path, the checks that stand
between a bad launch and the process, and when a layer declines it (always with the reason). The declared
variants against the attention modules of the families declaring them: the hybrids' gated full-attention layer
(partial rotary, the output gate; Qwen3-Next and Qwen3.5-MoE) and gpt-oss's windowed and full layers (sinks, the
window, YaRN), layer by layer and through whole decodes with the fused path on and off."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import moebench
from moebench.decode.cache import KVCache
from moebench.decode.loop import generate
from moebench.errors import UnsupportedKernelConfig
from moebench.execution import attention
from moebench.execution.attention import QKNorm, decode_attention, rope_frequencies, splits
from moebench.execution.executor import executor
from moebench.execution.steps import AttentionKernel, LayerWeights
from moebench.execution.support import attention_reason
from moebench.inspect.record import Recorder, Stepper
from moebench.inspect.truth import f64, nrms
from moebench.models import hooks
from moebench.models.declare import PER_HEAD, WHOLE_PROJECTION, AttentionSpec
from moebench.models.run import token_mixer
from moebench.tools.presets import get_preset, write_random
from moebench.tools.writer import write_random_checkpoint

BASE = 10000.0


def _inputs(heads: AttentionSpec, p: int, cap: int, dtype: mx.Dtype, bias: bool = True, seed: int = 0):
    keys = mx.random.split(mx.random.key(seed), 4)
    qkv = mx.random.normal((1, 1, heads.width), key=keys[0]).astype(dtype)
    b = mx.random.normal((heads.width,), key=keys[1]).astype(dtype) if bias else None
    shape = (1, heads.n_kv_heads, cap, heads.head_dim)
    cached_k, cached_v = (mx.random.normal(shape, key=k).astype(dtype) for k in keys[2:])
    return qkv, b, rope_frequencies(heads.head_dim, BASE), mx.array([p, cap], mx.int32), cached_k, cached_v


def _mlx_attention(qkv, bias, p, cached_k, cached_v, heads: AttentionSpec, qk_norm: QKNorm | None = None):
    """What the unfused layer computes: bias add, (Qwen3's per-head q/k RMSNorm,) mx.fast.rope, cache fetch,
    mx.fast SDPA."""
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    x = (qkv + bias if bias is not None else qkv).reshape(1, 1, h + 2 * kv, hd).transpose(0, 2, 1, 3)
    q, k, v = x[:, :h], x[:, h : h + kv], x[:, h + kv :]
    if qk_norm is not None:
        q, k = mx.fast.rms_norm(q, qk_norm.q, qk_norm.eps), mx.fast.rms_norm(k, qk_norm.k, qk_norm.eps)
    q, k = (mx.fast.rope(a, hd, traditional=False, base=BASE, scale=1.0, offset=p) for a in (q, k))
    keys = mx.concatenate([cached_k[:, :, :p], k], axis=2)
    values = mx.concatenate([cached_v[:, :, :p], v], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=hd**-0.5)
    return out.reshape(1, 1, h * hd), k, v


@pytest.mark.parametrize("heads,bias", [(AttentionSpec(4, 4, 64), True), (AttentionSpec(8, 2, 32), False),
                                        (AttentionSpec(2, 1, 96), True)])
@pytest.mark.parametrize("p", [0, 1, 9, 40])
def test_reference_matches_mlx_attention(heads, bias, p):
    qkv, b, inv, slots, cached_k, cached_v = _inputs(heads, p, 48, mx.float32, bias, seed=p)
    out, k_new, v_new = decode_attention("reference", qkv, b, inv, slots, cached_k, cached_v, heads)
    want, k, v = _mlx_attention(qkv, b, p, cached_k, cached_v, heads)
    assert out.shape == (1, 1, heads.n_heads * heads.head_dim) and k_new.shape == v_new.shape == k.shape
    assert np.abs(np.array(out) - np.array(want)).max() < 1e-5
    assert np.abs(np.array(k_new) - np.array(k)).max() < 1e-5 and np.array_equal(np.array(v_new), np.array(v))


def test_reference_never_reads_the_slots_past_the_position():
    heads = AttentionSpec(4, 2, 64)
    qkv, b, inv, slots, cached_k, cached_v = _inputs(heads, 5, 16, mx.float32)
    unread = mx.arange(16)[None, None, :, None] >= 5
    poisoned = [mx.where(unread, mx.nan, a) for a in (cached_k, cached_v)]
    clean = decode_attention("reference", qkv, b, inv, slots, cached_k, cached_v, heads)
    dirty = decode_attention("reference", qkv, b, inv, slots, *poisoned, heads)
    for a, c in zip(clean, dirty, strict=True):
        assert np.array_equal(np.array(a), np.array(c))


def test_bfloat16_rounds_where_mlx_rounds():
    heads = AttentionSpec(4, 4, 64)
    inputs = _inputs(heads, 20, 32, mx.bfloat16)
    out, k_new, _ = decode_attention("reference", *inputs, heads)
    _, k, _ = _mlx_attention(inputs[0], inputs[1], 20, inputs[4], inputs[5], heads)
    assert out.dtype == k_new.dtype == mx.bfloat16
    assert np.abs(f64(k_new) - f64(k)).max() <= 2**-7 * np.abs(f64(k)).max()  # rope's rounding, one step at most
    exact = decode_attention("reference", *(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a for a in inputs),
                             heads)[0]  # the same bf16 values, no rounding after them
    assert nrms(f64(out), f64(exact)) < 5e-3  # q, k and the output rounded to bf16: a few bf16 steps, no more


def test_bad_inputs_are_named_before_any_launch():
    """Each case differs from a good call in one respect, and raises every time (a failed check is never
    remembered as passed)."""
    heads = AttentionSpec(4, 4, 64)
    sinking, scaled = AttentionSpec(4, 4, 64, sinks=True), AttentionSpec(4, 4, 64, scaled_rope=True)
    gated = AttentionSpec(4, 4, 64, output_gate=True)
    qkv, b, inv, slots, cached_k, cached_v = _inputs(heads, 3, 16, mx.float32)
    decode_attention("reference", qkv, b, inv, slots, cached_k, cached_v, heads)
    cases = {
        "qkv has shape": ((qkv[..., :-1], b, inv, slots, cached_k, cached_v, heads), {}),
        "qkv bias": ((qkv, b.astype(mx.bfloat16), inv, slots, cached_k, cached_v, heads), {}),
        "inv_freq": ((qkv, b, inv[:-1], slots, cached_k, cached_v, heads), {}),
        "slots": ((qkv, b, inv, slots.astype(mx.float32), cached_k, cached_v, heads), {}),
        "cached keys": ((qkv, b, inv, slots, cached_k[:, :2], cached_v, heads), {}),
        "cached values": ((qkv, b, inv, slots, cached_k, cached_v.astype(mx.bfloat16), heads), {}),
        "cache block 1 is outside": ((qkv, b, inv, slots, cached_k, cached_v, heads, 1), {}),
        "multiple of 32": ((qkv, b, inv, slots, cached_k, cached_v, AttentionSpec(4, 4, 48)), {}),
        "cannot write the cache in place": ((qkv, b, inv, slots, cached_k, cached_v, heads), {"write": True}),
        # the declared variants' inputs
        "declares sinks: pass them": ((qkv, b, inv, slots, cached_k, cached_v, sinking), {}),
        "sinks given for an attention declaring none": ((qkv, b, inv, slots, cached_k, cached_v, heads),
                                                        {"sinks": mx.zeros((4,))}),
        "sinks \\(3,\\)": ((qkv, b, inv, slots, cached_k, cached_v, sinking), {"sinks": mx.zeros((3,))}),
        "sinks \\(4,\\) mlx.core.bfloat16": ((qkv, b, inv, slots, cached_k, cached_v, sinking),
                                               {"sinks": mx.zeros((4,), mx.bfloat16)}),
        "rope_scale nan": ((qkv, b, inv, slots, cached_k, cached_v, scaled), {"rope_scale": float("nan")}),
        "rope_scale 0": ((qkv, b, inv, slots, cached_k, cached_v, scaled), {"rope_scale": 0}),
        "declaring plain rotary": ((qkv, b, inv, slots, cached_k, cached_v, heads), {"rope_scale": 1.5}),
        "a sliding window of 0 positions": ((qkv, b, inv, slots, cached_k, cached_v, AttentionSpec(4, 4, 64, window=0)),
                                            {}),
        "expected one token's \\(1024,\\)": ((qkv, b, inv, slots, cached_k, cached_v, gated), {}),
        "the 16 rotated dims": ((qkv, b, inv, slots, cached_k, cached_v, AttentionSpec(4, 4, 64, rope_fraction=0.25)),
                                {}),
        "rotary on 24 of 64 dims": ((qkv, b, inv, slots, cached_k, cached_v,
                                     AttentionSpec(4, 4, 64, rope_fraction=0.375)), {}),
        "the kernel takes them clamped": ((qkv, b, inv, slots, cached_k, cached_v,
                                           AttentionSpec(4, 4, 64, clip_qkv=8.0)), {}),
    }
    for message, (args, kwargs) in cases.items():
        for _ in range(2):
            with pytest.raises(UnsupportedKernelConfig, match=message):
                decode_attention("reference", *args, **kwargs)
    with pytest.raises(UnsupportedKernelConfig, match="unknown fused backend"):
        decode_attention("vulkan", qkv, b, inv, slots, cached_k, cached_v, heads)


def test_support_reasons_and_splits():
    assert attention_reason(AttentionSpec(16, 16, 128)) is None and attention_reason(AttentionSpec(4, 2, 32)) is None
    assert "multiple of 32" in attention_reason(AttentionSpec(4, 4, 48))
    assert "do not divide" in attention_reason(AttentionSpec(6, 4, 64))
    # the declared variants the kernel computes: a quarter of each head rotated (256 -> 64, 64 -> 16, 32 -> 8), the
    # output gate, a window, sinks, scaled rotary; q, k and v clamped by the step unless normed inside the kernel
    for words in (dict(rope_fraction=0.25), dict(rope_fraction=0.5), dict(output_gate=True), dict(window=128),
                  dict(sinks=True), dict(scaled_rope=True), dict(clip_qkv=8.0),
                  dict(clip_qkv=8.0, qk_norm=WHOLE_PROJECTION)):
        for shape in ((16, 2, 256), (4, 2, 64), (4, 2, 32)):
            assert attention_reason(AttentionSpec(*shape, **words)) is None, (shape, words)
    assert "rotary on 24 of 64 dims" in attention_reason(AttentionSpec(4, 4, 64, rope_fraction=0.375))
    assert "rotary on 0 of 32 dims" in attention_reason(AttentionSpec(4, 4, 32, rope_fraction=0.01))
    assert "clamped at 8 after the per-head norm" in attention_reason(AttentionSpec(4, 4, 64, clip_qkv=8.0,
                                                                                    qk_norm=PER_HEAD))
    # a short cache: one threadgroup a key/value head, no join; a long one: about THREADGROUPS in all
    assert splits(1, 4) == splits(attention.SPLIT_POSITIONS, 4) == 1
    assert splits(attention.SPLIT_POSITIONS + 1, 4) == 2
    assert splits(10**7, 4) * 4 == splits(10**7, 16) * 16 == attention.THREADGROUPS
    assert splits(10**7, 3) * 3 >= attention.THREADGROUPS > (splits(10**7, 3) - 1) * 3


@pytest.mark.parametrize("heads", [AttentionSpec(4, 2, 64), AttentionSpec(8, 8, 32)])
@pytest.mark.parametrize("p", [0, 700, 2999])
def test_reference_with_the_qk_norm_matches_the_qwen3_attention(heads, p):
    """Qwen3's per-head q/k RMSNorm before RoPE, deep into a long cache too. Past a few hundred positions the
    float32 rotation angles round differently from mx.fast.rope's (both as far from a float64 rotation: about
    1e-4 at position 3000), so the bound there is the fused path's parity class, 5e-4."""
    qkv, _, inv, slots, cached_k, cached_v = _inputs(heads, p, 3000, mx.float32, False, seed=p)
    norm = QKNorm(mx.random.uniform(0.5, 1.5, (heads.head_dim,), key=mx.random.key(1)),
                  mx.random.uniform(0.5, 1.5, (heads.head_dim,), key=mx.random.key(2)), 1e-6)
    got = decode_attention("reference", qkv, None, inv, slots, cached_k, cached_v, heads, qk_norm=norm)
    want = _mlx_attention(qkv, None, p, cached_k, cached_v, heads, norm)
    for a, b in zip(got, want, strict=True):
        assert nrms(f64(a).reshape(-1), f64(b).reshape(-1)) < (1e-5 if p < 1000 else 5e-4)


def test_long_contexts_run_the_kernel(quantized_checkpoint):
    """No length declines the decode-attention kernel: every decode step of a context past the old 1024-slot
    bound (and past one split of the positions) runs it, and so do the MoE blocks."""
    model, _ = moebench.load(quantized_checkpoint)
    prompt = np.random.default_rng(0).integers(0, model.args.vocab_size, 1100).tolist()
    with moebench.fused_moe(True, model):
        result = generate(model, prompt, 4, compiled=False)
    with moebench.fused_moe(False, model):
        assert generate(model, prompt, 4, compiled=False).token_ids == result.token_ids
    backend, counts = moebench.available_backend(), moebench.dispatch(model)
    for part in ("attention", "moe"):
        for d in counts[part].values():
            assert d["fused"] == {backend: 3} and d["fallback"] == 1 + 4  # the prefills, and the fallback run


# ---- the declared variants, against the families' own attention -------------------------------------------------

FULL_LAYER = 3  # the hybrids' gated full-attention layer (the tiny presets: three Gated DeltaNet layers, then it)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(preset) -> a float32 model of that preset with random weights, as users make them: the hybrids' float
    folders, gpt-oss as make-random writes it (mlx-lm's layout: mxfp4 experts, 8-bit elsewhere)."""
    made = {}

    def get(preset: str, **fields):
        key = (preset, *sorted(fields.items()))
        if key not in made:
            folder = tmp_path_factory.mktemp(preset) / "ckpt"
            if get_preset(preset).config["model_type"] == "gpt_oss":
                write_random(folder, preset, bits=8, group_size=32, dtype="float32", seed=3, progress=False)
            else:
                config = {**get_preset(preset).config, **fields, "torch_dtype": "float32"}
                write_random_checkpoint(folder, config, seed=3)
            made[key] = moebench.load(folder)[0]
        return made[key]

    return get


def _layer_steps(model, layer: int, steps: int, seed: int = 0):
    """The layer's attention module (the fallback) and its fused step on the reference backend (o_proj's residual
    add inside it), each fed the same residual stream one token at a time over its own KV cache
    after the same 3-token prefill: yields (position, fallback output, fused output, fallback's recorded output
    gate, fused step's), the outputs with the stream taken away again."""
    attn, norm = token_mixer(model.layers[layer]), model.layers[layer].input_layernorm
    step = AttentionKernel(attn, LayerWeights(model.layers[layer]), "reference", False, model.dtype)
    d = model.args.hidden_size
    xs = mx.random.normal((3 + steps, 1, 1, d), key=mx.random.key(seed))
    fallback, fused = KVCache(), KVCache()
    prompt = norm(xs[:3].reshape(1, 3, d))
    mx.eval(attn(prompt, fallback), attn(prompt, fused))
    for i in range(steps):
        x, records = xs[3 + i], (Recorder(), Recorder())
        want, got = attn(norm(x), fallback, records[0]), step(norm, x, fused, records[1]) - x
        mx.eval(want, got)
        gates = [r.values.get(hooks.OUTPUT_GATE) for r in records]
        yield 3 + i, want, got, *gates


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "qwen3.5-moe-tiny"])
def test_the_hybrids_gated_full_attention_runs_as_the_module(family, preset):
    """Rotary on a quarter of each head (8 of 32 dims), the output gate inside the kernel, the per-head q/k norm:
    each decode step's output equals the module's within the kernel's float32 bound, and a recorded step records
    the module's output gate."""
    model = family(preset)
    spec = token_mixer(model.layers[FULL_LAYER]).spec
    assert spec.output_gate and spec.rope_fraction == 0.25 and attention_reason(spec) is None
    for position, want, got, gate, fused_gate in _layer_steps(model, FULL_LAYER, 40):
        assert got.shape == want.shape and nrms(f64(got), f64(want)) < 1e-5, position
        assert gate.shape == fused_gate.shape == (1, spec.n_heads, spec.head_dim)
        assert np.abs(f64(gate) - f64(fused_gate)).max() < 1e-6, position


@pytest.mark.parametrize("layer", [0, 1])  # the windowed layer (4 positions), the full one
def test_gpt_oss_attention_runs_as_the_module(family, layer):
    """Sinks, YaRN's frequencies and attention factor, biases, and on layer 0 the 4-position window: each decode
    step's output equals the module's, below and far past the window and across SPLIT_POSITIONS."""
    model = family("gpt-oss-tiny")
    spec = token_mixer(model.layers[layer]).spec
    assert spec.sinks and spec.scaled_rope and spec.window == (4 if layer == 0 else None)
    assert attention_reason(spec) is None
    for position, want, got, *gates in _layer_steps(model, layer, attention.SPLIT_POSITIONS + 8, seed=layer):
        assert gates == [None, None]
        assert nrms(f64(got), f64(want)) < 1e-5, position


def _sinks_matter(model, layer: int) -> None:
    """The checkpoint's sinks change the output (so the test above would see them dropped)."""
    attn = token_mixer(model.layers[layer])
    x = mx.random.normal((1, 4, model.args.hidden_size), key=mx.random.key(7))
    with_sinks = attn(x)
    saved = attn["sinks"]
    attn["sinks"] = mx.full(saved.shape, -1e4)
    try:
        assert nrms(f64(attn(x)), f64(with_sinks)) > 1e-3
    finally:
        attn["sinks"] = saved


def test_gpt_oss_sinks_and_window_change_what_the_layer_computes(family):
    model = family("gpt-oss-tiny")
    for layer in (0, 1):
        _sinks_matter(model, layer)


def test_olmoe_clamped_qkv_runs_as_the_module(family):
    """OLMoE's q, k and v clamped after the whole-projection norms: the step clamps them before the kernel, and
    each decode step's output equals the module's; the clamp bites on these weights."""
    model = family("olmoe-tiny", clip_qkv=0.5)
    attn = token_mixer(model.layers[1])
    assert attn.spec.clip_qkv == 0.5 and attention_reason(attn.spec) is None
    assert executor(model).plan_for(1, False).layers[1].attention.fused
    for position, want, got, *_ in _layer_steps(model, 1, 12):
        assert nrms(f64(got), f64(want)) < 1e-5, position
    x = mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(0))
    assert (mx.abs(attn.v_proj(x)) > 0.5).sum().item() > 0


def _decode(model, prompt: list[int], steps: int, fused: bool):
    with moebench.fused_moe(fused, model):
        return Stepper(model, None, prompt, keep_logits=True).run(steps)


@pytest.mark.parametrize("preset,layers,prompt", [("qwen3-next-tiny", [FULL_LAYER], 8),
                                                  ("qwen3.5-moe-tiny", [FULL_LAYER], 8),
                                                  ("gpt-oss-tiny", [0, 1], attention.SPLIT_POSITIONS - 4)])
def test_decodes_run_the_kernel_on_the_declared_layers(family, preset, layers, prompt):
    """With fused on, the plan runs the attention kernel on the hybrids' full-attention layer and on both gpt-oss
    layers (no decline); greedy tokens equal the fallback's and every step's logits lie within the fused path's
    float32 bound (gpt-oss's decode crosses SPLIT_POSITIONS, far past its window); the compiled step (the position
    a traced input) decodes the same tokens."""
    model = family(preset)
    plan = executor(model).plan_for(1, False)
    for i in layers:
        decision = plan.layers[i].attention
        assert decision.fused and decision.reason is None, (i, decision)
        assert isinstance(plan.layers[i].attention_step, AttentionKernel)
    ids = np.random.default_rng(5).integers(0, model.args.vocab_size, prompt).tolist()
    on, off = _decode(model, ids, 12, True), _decode(model, ids, 12, False)
    assert on.token_ids == off.token_ids
    for a, b in zip(on.generated, off.generated, strict=True):
        assert np.abs(a.logits - b.logits).max() < 1e-4, a.position
    with moebench.fused_moe(True, model):
        assert generate(model, ids, 12, compiled=True).token_ids == on.token_ids
