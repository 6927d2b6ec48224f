"""The launches a layer's plan declares for one decode token on the GPU path, checked against the graph that path
builds, here on the CPU: the plan takes backend 'cuda', every kernel launch and every mx.fast op the path calls
(rms_norm: the attention kernel does rope and attention itself) is a stand-in of one graph node, as each is on a
GPU, and one decode step's graph is built, never evaluated, and its primitives counted layer by layer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

import moebench
from moebench.decode.cache import StaticCache, StepPosition, layer_caches
from moebench.decode.compiled import CAPACITY_STEP, static_logits
from moebench.decode.loop import generate
from moebench.execution import executor as executor_module
from moebench.execution import kernel
from moebench.execution.executor import executor
from moebench.execution.plan import LayerPlan, Plan
from moebench.execution.steps import DECLARED_CAPACITY
from moebench.models.args import QuantizedParts
from moebench.tools.presets import get_preset, write_random
from moebench.tools.profile import graph_nodes
from moebench.tools.writer import write_random_checkpoint

# Declared launches a layer of each tiny model's eager decode step (a KVCache: the key and value writes are two slice
# updates; the compiled step's static cache is written in place by the kernel: two fewer, and on CUDA the kernel joins
# its partials itself: no combine launch, one fewer where the layer has one); None: not declared.
EAGER = {
    "tiny": (10, 10),  # Qwen2-MoE: the shared expert and its gate inside the MoE kernels
    "qwen3-tiny": (10, 10),
    "mixtral-tiny": (10, 10),
    "olmoe-tiny": (14, 14),  # q and k normed over the whole projection before the kernel: split, 2 norms, concatenate
    "olmoe-tiny clamped": (20, 20),  # and the q/k/v bias added, then q/k/v clamped, before it
    "gpt-oss-tiny": (9, 10),  # a window of 4 positions (no combine launch) every other layer; o_proj's bias inside
    "glm4-moe-tiny": (None, None, None),  # a dense first layer; the added shared expert's factor (shared_scale)
    "deepseek-v3-tiny": (None, None, None),  # latent attention by MLX ops, and GLM's MoE block
    "qwen3-next-tiny": (None, None, None, 10),  # linear attention: its in-projections are the family's own
    "qwen3.5-moe-tiny": (None, None, None, 10),
}
COMPILED = {
    "tiny": (7, 7),
    "qwen3-tiny": (7, 7),
    "mixtral-tiny": (7, 7),
    "olmoe-tiny": (11, 11),
    "olmoe-tiny clamped": (17, 17),
    "gpt-oss-tiny": (7, 7),  # the windowed layer had no combine launch to drop
    "glm4-moe-tiny": (None, None, None),
    "deepseek-v3-tiny": (None, None, None),
    "qwen3-next-tiny": (None, None, None, 7),
    "qwen3.5-moe-tiny": (None, None, None, 7),
}
HYBRIDS = ("qwen3-next-tiny", "qwen3.5-moe-tiny")
CLAMPED = "olmoe-tiny clamped"
# The stand-ins' primitive for each declared launch's op (the end of its name, in brackets).
PRIMITIVE = {"kernel": "Depends", "rms_norm": "Depends", "quantized matmul": "QuantizedMatmul", "add": "Add",
             "broadcast": "Broadcast", "slice_update": "SliceUpdate", "split": "Split", "concatenate": "Concatenate",
             "maximum": "Maximum", "minimum": "Minimum", "astype": "AsType"}
# The issue: a Qwen3-MoE layer of the compiled decode step (generate's default on CUDA) launches these 7 today (11
# before the rows kernel took the router's norm and o_proj's residual add in, 9 before kernel A took the router's
# selection in, 8 before the attention kernel joined its partials itself); the target is QWEN3_MOE_TARGET or fewer,
# not met yet.
QWEN3_MOE_LAUNCHES = ("input norm (rms_norm)", "q/k/v projection (quantized matmul)", "decode attention (kernel)",
                      "o_proj + residual (kernel)", "post-attention norm + router logits (kernel)",
                      "router + gate/up (kernel)",
                      "down + residual (kernel)")
QWEN3_MOE_TARGET = 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_hybrids) -> dict[str, Path]:
    """Each family's tiny preset as make-random writes it (bfloat16, 4-bit), OLMoE's with q/k/v biases and a clamp,
    and the hybrids' shared folders."""
    tmp = tmp_path_factory.mktemp("launches")
    made = {p: write_random(tmp / p, p, group_size=32, progress=False) for p in EAGER if p not in (*HYBRIDS, CLAMPED)}
    clamped = {**get_preset("olmoe-tiny").config, "attention_bias": True, "clip_qkv": 8.0, "torch_dtype": "bfloat16"}
    made[CLAMPED] = write_random_checkpoint(tmp / "clamped", clamped, bits=4, layout="stacked", dtype=mx.bfloat16)
    return {**made, **{p: tiny_hybrids[p] for p in HYBRIDS}}


def one_node(outputs, inputs: list) -> list[mx.array]:
    """Zero arrays of the outputs' (shape, dtype), evaluated, tied to every input by one mx.depends node."""
    zeros = [mx.zeros(shape, dtype) for shape, dtype in outputs]
    mx.eval(zeros)
    return mx.depends(zeros, [a for a in inputs if a is not None])


def stand_in_kernel(**_):
    """mx.fast.cuda_kernel's stand-in: each launch one node."""
    def launch(*, inputs, output_shapes, output_dtypes, **_):
        return one_node(zip(output_shapes, output_dtypes, strict=True), inputs)
    return launch


def stand_in_rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    return one_node([(x.shape, x.dtype)], [x, weight])[0]


def on_the_gpu_path(monkeypatch) -> None:
    """From here on, plans take backend 'cuda', and its kernels and mx.fast.rms_norm are one node each."""
    monkeypatch.setattr(executor_module, "available_backend", lambda: "cuda")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel, "_kernels", {})  # no stand-in outlives the test
    monkeypatch.setattr(mx.fast, "cuda_kernel", stand_in_kernel)
    monkeypatch.setattr(mx.fast, "rms_norm", stand_in_rms_norm)


class Kept:
    """A LayerRun that runs a layer's plan and keeps the layer's output (the feed-forward step's: residual + MLP)."""

    def __init__(self, plan: LayerPlan):
        self.plan, self.out = plan, None

    def attend(self, attn, norm, residual: mx.array, cache, record=None) -> mx.array:
        return self.plan.attend(attn, norm, residual, cache, record)

    def feed_forward(self, mlp, norm, residual: mx.array, record) -> mx.array:
        self.out = self.plan.feed_forward(mlp, norm, residual, record)
        return self.out


def nodes(*arrays: mx.array) -> Counter:
    """The primitives of the unevaluated graph behind `arrays`, by name."""
    graph = graph_nodes(*arrays)
    assert graph["error"] is None
    return Counter(graph["by_primitive"])


def decode_caches(model, static: bool) -> list:
    """Caches after a 4-token prompt, evaluated (run before the stand-ins): the decode loop's, or a compiled step's
    static cache of CAPACITY_STEP slots with its position (built once a step, outside the layers) evaluated."""
    ex = executor(model)
    if static:
        cache = StaticCache.for_model(model, CAPACITY_STEP, 1)
        cache.position = StepPosition.at(mx.array(4, mx.int32), CAPACITY_STEP)
        mx.eval(cache.arrays(), cache.position.offset, cache.position.start, cache.position.slots)
        return cache.layers()
    caches = layer_caches(model, keep=1)
    mx.eval(ex.forward(mx.array([[1, 2, 3, 4]]), caches, ex.plan(4, caches)), [c.state for c in caches])
    return caches


def nodes_per_layer(model, caches: list, plan: Plan) -> list[Counter]:
    """The primitives each layer adds to one decode step's graph: its token and what it writes into an eager
    decode's caches (a static cache is written in place by the kernels). Layer i > 0: the graph up to its output
    and cache writes less the graph up to layer i - 1's; layer 0: the rest, once the nodes outside the layers
    (embedding, final norm, lm_head, argmax: the same step built with no layers) are taken away."""
    ex, kept = executor(model), [Kept(lp) for lp in plan.layers]
    token = mx.array([[5]], mx.uint32)
    written = [() if plan.shape.static else c.state for c in caches]
    step = mx.argmax(ex.forward(token, caches, Plan(plan.key, tuple(kept), plan.shape)), axis=-1)
    upto = [nodes(k.out, *(a for w in written[: i + 1] for a in w)) for i, k in enumerate(kept)]
    whole = nodes(step, *(a for w in written for a in w))
    layers = model.model.layers
    model.model.layers = []
    try:
        outside = nodes(mx.argmax(ex.forward(token, caches, plan), axis=-1))
    finally:
        model.model.layers = layers
    first = whole - outside - (upto[-1] - upto[0])
    assert whole.total() - outside.total() == first.total() + upto[-1].total() - upto[0].total()
    return [first, *(upto[i] - upto[i - 1] for i in range(1, len(upto)))]


def primitives(names: tuple[str, ...]) -> Counter:
    """The stand-in graph's primitives the declared launches name."""
    return Counter(PRIMITIVE[name[name.rindex("(") + 1 : -1]] for name in names)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", EAGER)
def test_each_layer_builds_the_launches_its_plan_declares(folders, family, static, monkeypatch):
    """Every declared layer's graph on the GPU path is exactly its declared launches, node for node by primitive;
    a layer whose part runs as MLX ops the execution layer does not build declares none, and says why."""
    model, _ = moebench.load(folders[family])
    caches = decode_caches(model, static)
    on_the_gpu_path(monkeypatch)
    plan = executor(model).plan_for(1, static)
    declared = [lp.launches for lp in plan.layers]
    assert [d.count for d in declared] == list((COMPILED if static else EAGER)[family])
    for i, (launches, built) in enumerate(zip(declared, nodes_per_layer(model, caches, plan), strict=True)):
        if launches.names is None:
            assert launches.reason, i
        else:
            assert built == primitives(launches.names), (i, launches.names)


def test_qwen3_moe_launches_7_a_layer_today_against_a_target_of_6(folders, monkeypatch):
    """The issue tracks a Qwen3-MoE layer's launches on the GPU path's compiled decode step: 7 today (the eager
    step's KVCache writes add two, and its combine launch one, where the cache holds more than 128 slots), the
    target 6 or fewer. Not met yet: the exact count is asserted, so a change that adds a launch fails here and one
    that removes some updates QWEN3_MOE_LAUNCHES."""
    model, _ = moebench.load(folders["qwen3-tiny"])
    caches = decode_caches(model, static=True)
    on_the_gpu_path(monkeypatch)
    plan = executor(model).plan_for(1, True)
    assert DECLARED_CAPACITY == CAPACITY_STEP == 256  # the least a compiled step's cache holds: two splits a head
    for launches, built in zip((lp.launches for lp in plan.layers), nodes_per_layer(model, caches, plan), strict=True):
        assert launches.names == QWEN3_MOE_LAUNCHES, f"today's launches changed (target: {QWEN3_MOE_TARGET} or fewer)"
        assert built.total() == len(QWEN3_MOE_LAUNCHES) == 7
    assert plan.launches()["per_layer"] == 7 and plan.launches()["not_declared"] == {}


def test_the_last_decode_steps_launches_reach_dispatch_and_summary(folders):
    """moebench.dispatch and Executor.summary report what the last decode step's plan launches a layer (a prompt's
    plan is not a decode step's): each layer's names in dispatch, the mean and what is not declared in summary."""
    model, _ = moebench.load(folders["qwen3-tiny"])
    ex = executor(model)
    assert moebench.dispatch(model)["launches"] is None and ex.summary()["launches"] is None
    generate(model, [1, 2, 3], 3, compiled=False)
    eager = QWEN3_MOE_LAUNCHES[:3] + ("attention combine (kernel)", "key cache write (slice_update)",
                                      "value cache write (slice_update)") + QWEN3_MOE_LAUNCHES[3:]
    layers = moebench.dispatch(model)["launches"]["layers"]
    assert layers == {i: {"count": 10, "names": list(eager), "reason": None} for i in range(2)}
    assert ex.summary()["launches"] == {"per_layer": 10, "not_declared": {}}
    with moebench.fused_moe(False, model):
        generate(model, [1, 2, 3], 3, compiled=False)
    reason = ("attention by MLX ops: switched off (MOEBENCH_FUSED_MOE / set_fused_moe); MoE block by MLX ops: "
              "switched off (MOEBENCH_FUSED_MOE / set_fused_moe)")
    assert ex.summary()["launches"] == {"per_layer": None, "not_declared": {reason: 2}}


def test_a_static_cache_is_written_in_place_by_every_attention_layer_or_by_none(folders, monkeypatch):
    """Where a layer's q, k and v are stored differently (mlx_lm.convert's mixed_3_6 stores v_proj at 6 bits and q/k
    at 3 in some layers), its attention runs as MLX ops and the compiled step writes its keys and values by the
    static cache's update of the whole buffers: then no kernel writes the cache in place (the update would race the
    in-place writes), the fused layers' notes say why and declare the cache writes, and the step builds."""
    model, _ = moebench.load(folders["qwen3-tiny"])
    v = model.layers[1].self_attn.v_proj
    q, s, b = mx.quantize(mx.dequantize(v["weight"], v["scales"], v["biases"], group_size=v.group_size, bits=v.bits),
                          group_size=32, bits=8)
    v.set_weight(q, QuantizedParts(q, s, b, 32, 8, "affine"))
    cache = StaticCache.for_model(model, CAPACITY_STEP, 1)
    cache.position = StepPosition.at(mx.array(4, mx.int32), CAPACITY_STEP)
    mx.eval(cache.arrays(), cache.position.offset, cache.position.start, cache.position.slots)
    on_the_gpu_path(monkeypatch)
    plan = executor(model).plan_for(1, True)
    assert plan.layers[1].attention.reason == "q, k and v are stored differently (no stacked projection for the kernel)"
    fused = plan.layers[0]
    assert fused.attention.fused and not fused.attention_step.write
    assert fused.attention.note == "keys and values written by the cache's update, not in place: layers [1] run " \
                                   "attention by MLX ops"
    assert ("key cache write (slice_update)", "value cache write (slice_update)") == \
        fused.launches.names[4:6]
    logits = static_logits(executor(model), mx.array([[5]], mx.uint32), cache, plan)  # raised at the cache's commit
    assert logits.shape == (model.args.vocab_size,)
