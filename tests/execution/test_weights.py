"""What the kernels read, derived from the model's weights: stacked rows (one matmul for several Linears) that
follow replaced weights and share storage with the separate Linears, and the experts' quantized parts, which
follow replaced weights too."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np

from moebench.checkpoint.loader import load
from moebench.decode.cache import make_cache
from moebench.execution.executor import executor
from moebench.execution.weights import Derived, FusedWeights, RowStack, stack_rows
from moebench.models.args import QuantizedParts
from moebench.models.gpt_oss import Experts
from moebench.models.layers import Linear
from moebench.models.switch import SwitchGLU

KEY = mx.random.key(7)


def _quantized_linear(out_f: int, in_f: int, bits: int = 4, bias: bool = False, seed: int = 0) -> Linear:
    w = mx.random.normal((out_f, in_f), key=mx.random.key(seed))
    q, s, b = mx.quantize(w, group_size=64, bits=bits)
    linear = Linear(in_f, out_f, bias=bias)
    linear.set_weight(q, QuantizedParts(q, s, b, 64, bits, "affine"),
                      mx.arange(out_f, dtype=mx.float32) if bias else None)
    return linear


def _float_linear(out_f: int, in_f: int) -> Linear:
    linear = Linear(in_f, out_f)
    linear.set_weight(mx.zeros((out_f, in_f)))
    return linear


def test_row_stack_is_one_matmul_equal_to_the_separate_ones():
    parts = [_quantized_linear(n, 128, bias=True, seed=n) for n in (32, 16, 16)]
    stacked = RowStack(*parts).get()
    x = mx.random.normal((1, 3, 128), key=KEY)
    want = np.concatenate([np.array(p(x)) for p in parts], axis=-1)
    assert stacked.weight.shape[0] == 64 and np.array_equal(np.array(stacked(x)), want)


def test_row_stack_declines_linears_stored_differently():
    assert stack_rows(_quantized_linear(32, 128), _quantized_linear(16, 128, bits=8)) is None
    assert stack_rows(_quantized_linear(32, 128, bias=True), _quantized_linear(16, 128)) is None
    assert stack_rows(_float_linear(4, 128), _quantized_linear(16, 128)) is None
    assert RowStack(_float_linear(4, 128), _quantized_linear(16, 128)).get() is None


def test_row_stack_follows_replaced_weights_and_shares_storage():
    a, b = _quantized_linear(32, 128, seed=1), _quantized_linear(16, 128, seed=2)
    stack = RowStack(a, b)
    first = stack.get()
    assert stack.get() is first  # nothing replaced: the same stacked Linear, no rebuild
    stack.share_storage()
    assert stack.get() is first  # the views it points a and b at do not count as replaced
    x = mx.random.normal((1, 128), key=KEY)
    before = np.array(a(x))
    a.weight = _quantized_linear(32, 128, seed=3).weight  # a trained / reloaded weight
    rebuilt = stack.get()
    assert rebuilt is not first and not np.array_equal(np.array(rebuilt(x))[:, :32], before)


def test_row_stack_follows_a_quantized_weight_replaced_by_a_float_one_and_back():
    """A Linear whose scales and biases leave with a float weight (a dequantized router, say): the stack declines
    it rather than failing on the arrays it held before, and stacks again once both are quantized."""
    a, b = _quantized_linear(32, 128, seed=1), _quantized_linear(16, 128, seed=2)
    stack = RowStack(a, b)
    assert stack.get() is not None
    a.set_weight(mx.zeros((32, 128)))
    assert "scales" not in a and stack.get() is None
    q = _quantized_linear(32, 128, seed=3)
    a.set_weight(q.weight, q.quantized_parts())
    again = stack.get()
    x = mx.random.normal((1, 128), key=KEY)
    assert np.array_equal(np.array(again(x))[:, :32], np.array(q(x)))


def test_sharing_storage_frees_the_separate_copies():
    a, b = _quantized_linear(1024, 1024, seed=4), _quantized_linear(1024, 1024, seed=5)
    stack = RowStack(a, b)
    mx.eval(stack.get().parameters())
    x = mx.random.normal((1, 1024), key=KEY)
    want = np.array(stack.get()(x))
    gc.collect()
    before = mx.get_active_memory()
    stack.share_storage()
    gc.collect()
    freed = before - mx.get_active_memory()
    separate = sum(v.nbytes for m in (a, b) for v in (m.weight, m.scales, m.biases))
    assert freed >= 0.9 * separate, f"freed {freed} bytes, the separate arrays held {separate}"
    assert np.array_equal(np.concatenate([np.array(a(x)), np.array(b(x))], axis=-1), want)


def test_the_experts_parts_the_kernels_read_follow_replaced_weights(quantized_checkpoint):
    """Built once and handed back while nothing changed; after an expert array was replaced (a trained or
    reloaded weight) the parts hold the new array, and the fused step of a plan made before reads it."""
    model = load(quantized_checkpoint)[0]
    ex = executor(model)
    block, weights = model.layers[0].mlp, ex.weights[0]
    experts = block.switch_mlp
    first = weights.fused(block.parts())
    assert weights.fused(block.parts()) is first and first.experts[2].scales is experts.down_proj.scales
    step = ex.plan(1, make_cache(len(model.layers))).layers[0].moe_step
    x = mx.random.normal((1, 1, model.args.hidden_size), key=KEY)
    norm = model.layers[0].post_attention_layernorm
    before = np.array(step(norm, x, None))
    experts.down_proj.scales = experts.down_proj.scales * 2
    again = weights.fused(block.parts())
    assert again is not first and again.experts[2].scales is experts.down_proj.scales
    assert weights.fused(block.parts()) is again
    after = np.array(step(norm, x, None))
    assert not np.allclose(after, before, rtol=1e-3, atol=1e-3)
    assert np.allclose(after, np.array(x + block(norm(x))), rtol=1e-4, atol=1e-4)  # the fallback, new weights


def test_the_expert_biases_the_kernels_read_follow_replaced_biases():
    """Experts with biases (gpt-oss): the fused weights hand the kernel pair the projections' own bias arrays, and
    a replaced bias (a trained or reloaded one) is read from the next call on; unbiased experts have none."""
    experts = Experts(64, 32, 4, 7.0, 1.702)
    for proj in (experts.gate_proj, experts.up_proj, experts.down_proj):
        proj.set_weight(*_quantized_parts(mx.random.normal(proj.weight.shape, key=KEY)))
        proj.bias = mx.random.normal(proj.bias.shape, key=KEY)
    derived = Derived(FusedWeights.build)
    first = derived.get(experts.gate_proj, experts.up_proj, experts.down_proj)
    assert [b is p.bias for b, p in zip(first.biases, (experts.gate_proj, experts.up_proj, experts.down_proj),
                                         strict=True)] == [True] * 3
    experts.up_proj.bias = experts.up_proj.bias + 1
    again = derived.get(experts.gate_proj, experts.up_proj, experts.down_proj)
    assert again is not first and again.biases[1] is experts.up_proj.bias
    plain = SwitchGLU(64, 32, 4)
    for proj in (plain.gate_proj, plain.up_proj, plain.down_proj):
        proj.set_weight(*_quantized_parts(mx.random.normal(proj.weight.shape, key=KEY)))
    assert FusedWeights.build(plain.gate_proj, plain.up_proj, plain.down_proj).biases is None


def _quantized_parts(w: mx.array) -> tuple[mx.array, QuantizedParts]:
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    return q, QuantizedParts(q, s, b, 32, 4, "affine")
