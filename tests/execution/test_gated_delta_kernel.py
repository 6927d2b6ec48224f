"""The fused Gated DeltaNet decode step (moebench.execution.linear_attention, kernels/gated_delta.body).

The reference backend against the float64 truth of one step (moebench.inspect.truth.gated_delta_f64): grouped and
ungrouped heads, a strong decay (g near 0), none (g = 1), states that are not zero, float32 and bfloat16. The Metal
twin of the kernel compiled with g++ against kernels/metal_cpu_shim.h (CI has no Apple GPU) and run on the CPU
against the reference (in bfloat16 as it rounds on Metal and CUDA) at several head shapes, both dtypes, and on the
inputs the H200 found where q and k nearly cancel. The decode of tiny Qwen3-Next and Qwen3.5-MoE
checkpoints (`moebench make-random`'s) with the step fused and not: the plan runs the linear layers through it,
64 steps decode the same tokens and logits, the module's own layer and the fused step agree step after step, a
recorded step records what the module records, and a Stepper that rolls back or is interrupted after fused steps
finds every state as it was. A layer the kernel cannot take falls back and the dispatch counts say why; inputs it
cannot take are named errors before MLX sees them.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from execution.gpu_rounding import gpu_sigmoid
from gpu.test_cuda_gated_delta import random_step_inputs
from hybrids import HYBRID_PRESETS, assert_back_at_and_resumes

import moebench
from moebench.decode.loop import Session, generate, generate_tokens
from moebench.decode.state import LinearAttentionState
from moebench.errors import UnsupportedKernelConfig
from moebench.execution import linear_attention
from moebench.execution.executor import executor
from moebench.execution.kernel import KERNEL_DIR, LANES, compact, kernel_source
from moebench.execution.linear_attention import (
    GATED_DELTA,
    WARPS,
    GatedDeltaWeights,
    constants,
    gated_delta_step,
    reference_gated_delta,
)
from moebench.execution.settings import KernelSettings
from moebench.execution.steps import LinearAttentionKernel
from moebench.execution.support import linear_attention_reason
from moebench.inspect.record import Stepper
from moebench.inspect.truth import gated_delta_f64, nrms
from moebench.models.declare import GATED_DELTA as GATED_DELTA_KIND
from moebench.models.declare import LinearAttentionSpec
from moebench.tools.presets import get_preset
from moebench.tools.writer import write_random_checkpoint

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
STEPS = 64
# (key heads, value heads, key_head_dim, value_head_dim, conv taps): grouped (Hv = 2 Hk) at the tiny presets' size,
# Hv = Hk, three value heads a key head of a width that is no multiple of 32 nor of a warp's block of rows (4) and
# two taps, and the shape of Qwen3.5-35B-A3B / Qwen3-Next-80B-A3B (16 key heads serving 32 value heads of 128, 4 taps)
SHAPES = ((2, 4, 32, 32, 4), (4, 4, 64, 64, 4), (1, 3, 64, 34, 2), (16, 32, 128, 128, 4))
DECAYS = ("typical", "strong", "none")


def spec_of(shape: tuple[int, ...]) -> LinearAttentionSpec:
    return LinearAttentionSpec(GATED_DELTA_KIND, *shape)


def step_inputs(spec: LinearAttentionSpec, decay: str = "typical", dtype: mx.Dtype = mx.float32, seed: int = 0):
    """One token's (qkv, z, b, a, conv state, delta state) and the layer's weights, random at useful sizes: a strong
    decay puts g near 0 (A_log and a + dt_bias large), none puts it at 1 (softplus(a + dt_bias) under float32's
    resolution of g); the states are not zero."""
    rng = np.random.default_rng(seed)
    hk, hv, dk, dv, taps = (spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim,
                            spec.conv_kernel)
    channels = 2 * hk * dk + hv * dv

    def arr(shape, scale=1.0, shift=0.0, dt=dtype):
        return mx.array((shift + scale * rng.standard_normal(shape)).astype(np.float32)).astype(dt)

    a_shift, a_log_shift = {"typical": (0.0, 0.0), "strong": (12.0, 2.0), "none": (-40.0, 0.0)}[decay]
    weights = GatedDeltaWeights(arr((channels, taps, 1), 0.5), arr((hv,), 0.5, a_log_shift, mx.float32),
                                arr((hv,), 0.5, a_shift), arr((dv,), 0.2, 1.0), 1e-6)
    inputs = (arr((1, 1, channels)), arr((1, 1, hv, dv)), arr((1, 1, hv)), arr((1, 1, hv)),
              arr((1, taps - 1, channels)), arr((1, hv, dv, dk), 0.3, dt=mx.float32))
    return inputs, weights


# ---- the reference backend against the float64 truth -------------------------------------------------------

@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_reference_step_matches_the_float64_truth(shape, decay):
    spec = spec_of(shape)
    inputs, weights = step_inputs(spec, decay, seed=sum(shape))
    out, conv, state = (np.array(x) for x in gated_delta_step("reference", *inputs, weights, spec))
    want_out, want_conv, want_state = gated_delta_f64(*inputs, weights, spec)
    assert out.shape == (1, 1, spec.num_value_heads * spec.value_head_dim) and conv.shape == inputs[4].shape
    assert nrms(out.reshape(-1), want_out) < 1e-5
    assert np.array_equal(conv[0], want_conv)  # the window moved on by one position, exactly
    assert nrms(state[0], want_state) < 1e-5
    if decay == "strong":  # g near 0: the state held before is forgotten, what is left is this token's write
        fresh = gated_delta_f64(*inputs[:5], mx.zeros_like(inputs[5]), weights, spec)[2]
        assert np.abs(want_state - fresh).max() < 1e-6 and np.abs(np.array(inputs[5])).max() > 0.5
    if decay == "none":  # g = 1: the state keeps everything it held
        g = np.exp(-np.exp(np.array(weights.a_log, np.float64)) * np.logaddexp(0, np.array(inputs[3]).reshape(-1)
                                                                           + np.array(weights.dt_bias)))
        assert np.all(g.astype(np.float32) == 1.0)


def test_reference_step_in_bfloat16_stays_within_its_rounding():
    spec = spec_of(SHAPES[0])
    inputs, weights = step_inputs(spec, dtype=mx.bfloat16, seed=5)
    out, conv, state = gated_delta_step("reference", *inputs, weights, spec)
    assert out.dtype == conv.dtype == mx.bfloat16 and state.dtype == mx.float32
    want_out, _, want_state = gated_delta_f64(*inputs, weights, spec)
    assert nrms(np.array(out.astype(mx.float32)).reshape(-1), want_out) < 2e-2
    assert nrms(np.array(state)[0], want_state) < 2e-2


# ---- inputs the kernel cannot take -------------------------------------------------------------------------

def test_what_the_kernel_cannot_run_is_declined_by_its_declaration():
    assert linear_attention_reason(spec_of((16, 32, 128, 128, 4))) is None
    cases = {
        LinearAttentionSpec("another linear attention", 2, 4, 32, 32, 4): "another linear attention",
        spec_of((2, 4, 48, 32, 4)): "key_head_dim 48 (the kernel needs a multiple of 32 up to 256)",
        spec_of((2, 4, 512, 32, 4)): "key_head_dim 512",
        spec_of((2, 3, 32, 32, 4)): "3 value heads do not divide into 2 key heads",
        spec_of((2, 4, 32, 32, 1)): "a convolution of 1 tap",
    }
    for spec, reason in cases.items():
        assert reason in linear_attention_reason(spec)
        inputs, weights = step_inputs(spec_of((2, 4, 32, 32, 4)))
        with pytest.raises(UnsupportedKernelConfig, match=reason.split(" (")[0]):
            gated_delta_step("reference", *inputs, weights, spec)


def test_bad_inputs_are_named_before_mlx_sees_them():
    spec = spec_of(SHAPES[0])
    (qkv, z, b, a, conv, state), weights = step_inputs(spec)
    bad = {
        "qkv": ((qkv[..., 1:], z, b, a, conv, state), weights),
        "z": ((qkv, z.astype(mx.float16), b, a, conv, state), weights),
        "delta state": ((qkv, z, b, a, conv, state.astype(mx.bfloat16)), weights),
        "conv state": ((qkv, z, b, a, mx.concatenate([conv, conv], axis=0), state), weights),
        "A_log": ((qkv, z, b, a, conv, state), GatedDeltaWeights(weights.conv, weights.a_log[:2], weights.dt_bias,
                                                                 weights.norm, weights.eps)),
        "norm eps": ((qkv, z, b, a, conv, state), GatedDeltaWeights(weights.conv, weights.a_log, weights.dt_bias,
                                                                    weights.norm, float("nan"))),
    }
    for name, (inputs, w) in bad.items():
        with pytest.raises(UnsupportedKernelConfig, match=f"gated delta step: {name}"):
            gated_delta_step("reference", *inputs, w, spec)
    batch = tuple(mx.concatenate([x, x]) for x in (qkv, z, b, a, conv, state))  # two sequences: one token of one
    with pytest.raises(UnsupportedKernelConfig, match=r"qkv \(2, 1, 256\)"):
        gated_delta_step("reference", *batch, weights, spec)
    with pytest.raises(UnsupportedKernelConfig, match="unknown fused backend 'rocm'"):
        gated_delta_step("rocm", qkv, z, b, a, conv, state, weights, spec)


# ---- the Metal twin through the C++ shim ------------------------------------------------------------------

TEMPLATE = ("T", "HK", "HV", "DK", "DV", "KC", "W")
FLOAT32_PARAMS = ("a_log", "consts", "state", "state_new")  # float32 whatever the activations' dtype
C_TYPES = {mx.float32: "float", mx.bfloat16: "bfloat16_t"}


def _instance(shape: tuple[int, ...], dtype: mx.Dtype) -> dict[str, object]:
    return dict(zip(TEMPLATE, (C_TYPES[dtype], *shape, WARPS), strict=True))


def _sizes(inst: dict[str, object]) -> dict[str, int]:
    """Each parameter's elements at this instance's shapes (what MLX's metal_kernel reads to put < 8 in `constant`)."""
    hk, hv, dk, dv, kc = (int(inst[n]) for n in TEMPLATE[1:6])
    channels = 2 * hk * dk + hv * dv
    return {"qkv": channels, "z": hv * dv, "b": hv, "a": hv, "conv_state": (kc - 1) * channels,
            "conv_w": channels * kc, "a_log": hv, "dt_bias": hv, "norm_w": dv, "consts": 3, "state": hv * dv * dk,
            "out": hv * dv, "conv_new": (kc - 1) * channels, "state_new": hv * dv * dk}


def _name(inst: dict[str, object]) -> str:
    return "run_gated_delta_" + "_".join(map(str, inst.values()))


def _unit(instances: list[dict[str, object]]) -> str:
    """The shim, the Metal prelude and one kernel per instance as MLX's metal_kernel writes it (template constants
    as constexpr), each with an extern "C" launcher running HV + 1 threadgroups of W simdgroups (the last pads)."""
    header, source = kernel_source("metal", GATED_DELTA)
    parts = [f'#include "{KERNEL_DIR / "metal_cpu_shim.h"}"', header]
    for inst in instances:
        sizes, t = _sizes(inst), inst["T"]
        params = [f"const {'constant' if sizes[n] < 8 else 'device'} {'float' if n in FLOAT32_PARAMS else t}* {n}"
                  for n in GATED_DELTA.inputs]
        params += [f"device {'float' if n in FLOAT32_PARAMS else t}* {n}" for n in GATED_DELTA.outputs]
        consts = "".join(f"  using {n} = {v};\n" if n == "T" else f"  constexpr int {n} = {v};\n"
                         for n, v in inst.items())
        buffers = ", ".join(f"static_cast<{'const ' * (n in GATED_DELTA.inputs)}"
                            f"{'float' if n in FLOAT32_PARAMS else t}*>(buf[{i}])"
                            for i, n in enumerate(GATED_DELTA.inputs + GATED_DELTA.outputs))
        kernel = f"kernel_{_name(inst)}"
        parts.append(f"void {kernel}({', '.join(params)}, uint3 thread_position_in_grid) {{\n{consts}{source}\n}}")
        parts.append(f'extern "C" void {_name(inst)}(void* const* buf) {{\n'
                     f"  mb_shim_launch_threadgroups({inst['HV']} + 1, {inst['W']}, [&](uint3 t) {{ {kernel}("
                     f"{buffers}, t); }});\n}}")
    return "\n\n".join(parts)


SHIM_RUNS = [(shape, dtype) for shape in SHAPES[:3] for dtype in (mx.float32, mx.bfloat16)]


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> ctypes.CDLL:
    """The kernel's Metal twin built with g++ against the shim (any compile error fails the tests), at every run
    shape and the full-size one."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    folder = tmp_path_factory.mktemp("gated_delta_shim")
    src, lib = folder / "gated_delta_shim.cpp", folder / "libgateddelta.so"
    instances = [_instance(shape, dtype) for shape, dtype in SHIM_RUNS + [(SHAPES[3], mx.bfloat16)]]
    src.write_text(_unit(instances))
    done = subprocess.run(["g++", "-std=c++20", "-O1", "-Wall", "-Werror", "-Wno-unused-variable",
                           "-Wno-unused-but-set-variable", "-fPIC", "-shared", "-pthread", str(src), "-o", str(lib)],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"the gated delta kernel does not compile under the shim:\n{done.stderr[-6000:]}"
    return ctypes.CDLL(str(lib))


def _host(a: mx.array) -> np.ndarray:
    """An input as the kernel reads it: row-contiguous, bfloat16 as its bits."""
    return np.ascontiguousarray(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)).reshape(-1)


def _run_shim(lib: ctypes.CDLL, inputs, weights: GatedDeltaWeights, spec: LinearAttentionSpec):
    qkv, z, b, a, conv, state = inputs
    dtype = qkv.dtype
    inst = _instance((spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim,
                      spec.conv_kernel), dtype)
    host = {"qkv": qkv, "z": z, "b": b, "a": a, "conv_state": conv, "conv_w": weights.conv, "a_log": weights.a_log,
            "dt_bias": weights.dt_bias, "norm_w": weights.norm, "consts": constants(spec.key_head_dim, weights.eps),
            "state": state}
    buffers = {n: _host(x) for n, x in host.items()}
    sizes = _sizes(inst)
    for n in GATED_DELTA.outputs:  # NaN bits: whatever the kernel leaves unwritten shows
        wide = n in FLOAT32_PARAMS or dtype == mx.float32
        buffers[n] = np.full(sizes[n], np.nan, np.float32) if wide else np.full(sizes[n], 0x7FC0, np.uint16)
    names = GATED_DELTA.inputs + GATED_DELTA.outputs
    for n in names:
        assert buffers[n].size == sizes[n], n
    getattr(lib, _name(inst))((ctypes.c_void_p * len(names))(*(buffers[n].ctypes.data for n in names)))

    def back(n: str) -> np.ndarray:
        x = buffers[n]
        return np.array(mx.array(x).view(mx.bfloat16).astype(mx.float32)) if x.dtype == np.uint16 else x

    return tuple(back(n) for n in GATED_DELTA.outputs)


def gpu_rounded_reference(monkeypatch, inputs, weights: GatedDeltaWeights, spec: LinearAttentionSpec):
    """The reference backend's step as it rounds on the GPU the kernel runs on: nn.silu through gpu_sigmoid (the
    only op of the step whose rounding MLX's CPU and GPUs differ on), as float32 arrays."""
    with monkeypatch.context() as patch:
        patch.setattr(nn, "silu", lambda x: x * gpu_sigmoid(x))
        return [np.array(x.astype(mx.float32)).reshape(-1) for x in reference_gated_delta(*inputs, weights, spec)]


def _check_shimmed_step(shim, monkeypatch, inputs, weights: GatedDeltaWeights, spec: LinearAttentionSpec,
                        case: str) -> None:
    """Every output element written; the conv state moved on exactly; float32 within float32 rounding of the
    reference. bfloat16: the kernel rounds where the reference rounds on Metal and CUDA, so against that
    (gpu_rounded_reference) only the order of float32 sums is left: the state within float32 rounding, the output
    within a unit of bfloat16's last place (2^-8 relative: a last bit flipped here and there), and as near the
    float64 truth as that reference is."""
    got = _run_shim(shim, inputs, weights, spec)
    if inputs[0].dtype == mx.float32:
        want = [np.array(x).reshape(-1) for x in gated_delta_step("reference", *inputs, weights, spec)]
    else:
        want = gpu_rounded_reference(monkeypatch, inputs, weights, spec)
    truth = [x.reshape(-1) for x in gated_delta_f64(*inputs, weights, spec)]
    for name, g, w, exact in zip(GATED_DELTA.outputs, got, want, truth, strict=True):
        assert np.isfinite(g).all(), f"{name}: not every element written"
        if name == "conv_new":
            assert np.array_equal(g, w), "the conv state moves on exactly"
        elif inputs[0].dtype == mx.float32 or name == "state_new":
            assert nrms(g, w) < 1e-6, (name, case, nrms(g, w))
        else:
            assert nrms(g, w) < 2**-8, (name, case, nrms(g, w))
            assert nrms(g, exact) < 1.5 * nrms(w, exact) + 1e-3, (name, case, nrms(g, exact), nrms(w, exact))


@pytest.mark.parametrize("shape,dtype", SHIM_RUNS, ids=str)
def test_shimmed_kernel_matches_the_reference_on_cpu(shim, monkeypatch, shape, dtype):
    spec = spec_of(shape)
    for decay in DECAYS:
        inputs, weights = step_inputs(spec, decay, dtype, seed=sum(shape) + 1)
        _check_shimmed_step(shim, monkeypatch, inputs, weights, spec, decay)


@pytest.mark.parametrize("decay", DECAYS)
def test_shimmed_kernel_rounds_as_the_gpu_reference_where_q_and_k_nearly_cancel(shim, monkeypatch, decay):
    """The inputs the H200 run of tests/gpu/test_cuda_gated_delta.py failed on in bfloat16 (three value heads of 34
    on one key head, two taps): q . k is 0.4% of |q| |k|, so o = S q cancels, and with a strong decay the gated
    norm's eps outweighs o's mean square - the output follows q . k, where every bfloat16 rounding of q and k
    counts. A kernel that rounded SiLU's sigmoid once (not op by op as MLX's GPUs do) was 1.1e-1 from the truth
    where CUDA's reference is 5.0e-2, and 1.7e-1 from that reference."""
    shape = SHAPES[2]
    inputs, weights = random_step_inputs(shape, decay, mx.bfloat16, seed=sum(shape))
    _check_shimmed_step(shim, monkeypatch, inputs, weights, spec_of(shape), decay)


def test_shimmed_kernel_at_full_size_matches_the_float64_truth(shim):
    """Qwen3.5-35B-A3B's shape (16 key heads serving 32 value heads of 128) in bfloat16."""
    spec = spec_of(SHAPES[3])
    inputs, weights = step_inputs(spec, dtype=mx.bfloat16, seed=11)
    out, conv, state = _run_shim(shim, inputs, weights, spec)
    want_out, want_conv, want_state = gated_delta_f64(*inputs, weights, spec)
    assert nrms(out, want_out) < 2e-2 and nrms(state.reshape(want_state.shape), want_state) < 2e-2
    assert np.array_equal(conv.reshape(want_conv.shape), want_conv)


def test_each_backend_wraps_its_prelude_around_the_same_body():
    body = compact((KERNEL_DIR / GATED_DELTA.body).read_text())
    assert all(kernel_source(backend, GATED_DELTA)[1].endswith(body) for backend in ("metal", "cuda"))


def test_cuda_source_compiles_with_nvcc(tmp_path):
    """The CUDA prelude and the body wrapped as MLX's cuda_kernel wraps them, at the full-size shape in bfloat16
    and a grouped one in float32."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    header, source = kernel_source("cuda", GATED_DELTA)
    parts = ["#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>", header, "namespace mlx::core::cu {"]
    for n, (shape, dtype) in enumerate([(SHAPES[3], "__nv_bfloat16"), (SHAPES[2], "float")]):
        params = [f"const {'float' if p in FLOAT32_PARAMS else dtype}* {p}" for p in GATED_DELTA.inputs]
        params += [f"{'float' if p in FLOAT32_PARAMS else dtype}* {p}" for p in GATED_DELTA.outputs]
        consts = "".join(f"  using {k} = {dtype};\n" if k == "T" else f"  constexpr int {k} = {v};\n"
                         for k, v in _instance(shape, mx.float32).items())
        parts.append(f"__global__ void gated_delta_{n}({', '.join(params)}) {{\n{consts}{source}\n}}")
    parts.append("}  // namespace mlx::core::cu")
    src = tmp_path / "gated_delta.cu"
    src.write_text("\n\n".join(parts))
    done = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "gated_delta.o"),
                           "-Werror", "all-warnings"], capture_output=True, text=True)
    assert done.returncode == 0, f"CUDA source does not compile:\n{done.stderr[-6000:]}"


def test_the_kernel_launch_geometry_is_what_the_shim_runs():
    """The wrapper launches one threadgroup of WARPS rows of 32 lanes per value head, as the shim's launcher."""
    assert LANES == 32 and "const uint32_t h = mb_row / uint32_t(W);" in (KERNEL_DIR / GATED_DELTA.body).read_text()
    source = Path(linear_attention.__file__).read_text()
    assert "grid=(LANES, hv * WARPS, 1), threadgroup=(LANES, WARPS, 1)" in source


# ---- decoding the hybrids ---------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", HYBRID_PRESETS)
def test_fused_decode_equals_the_fallback_for_64_steps(tiny_hybrids, preset):
    """The plan runs every linear layer's decode step through the kernel (prefill falls back, one token at a time
    is what it runs); the tokens and every step's logits over 64 steps are the fallback's."""
    model, _ = moebench.load(tiny_hybrids[preset])
    ex = executor(model)
    plan = ex.plan_for(1, False)
    assert [layer.attention.path for layer in plan.layers[:3]] == ["reference"] * 3
    assert all(isinstance(layer.attention_step, LinearAttentionKernel) for layer in plan.layers[:3])
    assert ex.plan_for(5, False).layers[0].attention.reason == "5 tokens (the kernel runs single-token decode)"
    switched = ex.plan_for(1, False, KernelSettings(attention_kernel=False)).layers
    assert [layer.attention.reason for layer in switched] == [
        "the gated delta kernel switched off (KernelSettings.attention_kernel)"] * 3 + [
        "the attention kernel switched off (KernelSettings.attention_kernel)"]
    runs = {}
    for fused in (True, False):
        with moebench.fused_moe(fused, model):
            ex.reset_counts()
            pairs = list(generate_tokens(model, PROMPT, STEPS, compiled=False))
            runs[fused] = [t for t, _ in pairs], np.stack([np.array(logits) for _, logits in pairs])
            counts = moebench.dispatch(model)["attention"][0]
            assert counts["fused"] == ({"reference": STEPS - 1} if fused else {})
    assert runs[True][0] == runs[False][0] and len(set(runs[True][0])) > 4
    assert np.abs(runs[True][1] - runs[False][1]).max() <= 1e-4


def test_a_linear_layer_the_kernel_cannot_take_falls_back_and_says_why(tmp_path):
    """Key heads of 48 dims (no multiple of 32): every decode step of every linear layer runs the module, and the
    dispatch counts name why."""
    config = {**get_preset("qwen3.5-moe-tiny").config, "torch_dtype": "float32", "linear_key_head_dim": 48}
    model, _ = moebench.load(write_random_checkpoint(tmp_path / "ckpt", config, seed=5))
    executor(model).reset_counts()
    assert len(generate(model, PROMPT, 4).token_ids) == 4
    for i in range(3):
        assert moebench.dispatch(model)["attention"][i] == {
            "fused": {}, "fallback": 4, "notes": {}, "reasons": {
                "8 tokens (the kernel runs single-token decode)": 1,
                "key_head_dim 48 (the kernel needs a multiple of 32 up to 256)": 3}}


@pytest.mark.parametrize("preset", HYBRID_PRESETS)
def test_the_fused_step_keeps_the_module_s_states_step_by_step(tiny_hybrids, preset):
    """Layer 0's GatedDeltaNet and the fused step, each on its own cache, fed the same inputs for 64 steps after
    a prompt (the step normalises its input itself): outputs within 1e-5 and states that do not drift apart."""
    model, _ = moebench.load(tiny_hybrids[preset])
    net = model.layers[0].linear_attn
    step = LinearAttentionKernel(net, "reference")
    module_cache, fused_cache = LinearAttentionState(2), LinearAttentionState(2)
    x = mx.random.normal((1, 5 + STEPS, model.args.hidden_size), key=mx.random.key(1))
    for cache in (module_cache, fused_cache):
        net(x[:, :5], cache)
    norm = model.layers[0].input_layernorm
    for t in range(5, 5 + STEPS):  # the step takes the residual stream and the norm, and adds its output to it
        token = x[:, t : t + 1]
        want, got = net(norm(token), module_cache), step(norm, token, fused_cache) - token
        assert mx.abs(got - want).max().item() <= 1e-5
    assert module_cache.offset == fused_cache.offset == 5 + STEPS
    assert mx.abs(fused_cache.delta - module_cache.delta).max().item() <= 1e-5
    assert mx.array_equal(fused_cache.conv, module_cache.conv).item()


def test_a_recorded_fused_step_records_what_the_module_records(tiny_hybrids):
    model, _ = moebench.load(tiny_hybrids["qwen3-next-tiny"])
    traces = {}
    for fused in (True, False):
        stepper = Stepper(model, None, PROMPT, record=True, fused=fused, pipeline=False)
        traces[fused] = stepper.run(3)
    on, off = traces[True].steps[-1].layers, traces[False].steps[-1].layers
    assert on[0].attn_path.path == "reference" and not off[0].attn_path.fused
    for i in range(3):
        for name in ("decay", "beta", "state_norm", "output_gate"):
            a, b = getattr(on[i], name), getattr(off[i], name)
            assert a is not None and a.shape == b.shape and np.abs(a - b).max() <= 1e-5, (i, name)


def test_a_rolled_back_fused_step_leaves_the_states_as_they_were(tiny_hybrids, monkeypatch):
    """A pipelined Stepper builds the next step ahead (through the kernels); feeding another token rolls it back:
    the tokens and logits after that equal a decode that never built it, bit for bit."""
    model, _ = moebench.load(tiny_hybrids["qwen3.5-moe-tiny"])
    fed, rolled = [101, 7, 55], []
    original = Session.rollback
    monkeypatch.setattr(Session, "rollback", lambda self, step: (rolled.append(step.position), original(self, step)))
    records = {}
    for pipeline in (True, False):
        stepper = Stepper(model, None, PROMPT, keep_logits=True, pipeline=pipeline, fused=True)
        stepper.prefill()
        for n in range(10):
            stepper.step(feed=fed[n % 3] if n in (2, 5, 6) else None)
        records[pipeline] = stepper.trace
    assert len(rolled) >= 3  # the pipelined decode took back a step built ahead at each fed token
    assert records[True].token_ids == records[False].token_ids
    for a, b in zip(records[True].steps, records[False].steps, strict=True):
        assert np.array_equal(a.logits, b.logits), a.position


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_stepper_interrupted_inside_a_fused_step_is_back_at_its_last_whole_step(tiny_hybrids, monkeypatch, pipeline):
    """An interrupt in layer 1's fused step (after layer 0's wrote its states) leaves every cache at the last whole
    step; resuming decodes what an uninterrupted decode does, bit for bit."""
    model, _ = moebench.load(tiny_hybrids["qwen3-next-tiny"])
    straight = Stepper(model, None, PROMPT, keep_logits=True, pipeline=pipeline, fused=True).run(12)
    stepper = Stepper(model, None, PROMPT, keep_logits=True, pipeline=pipeline, fused=True, max_tokens=12)
    stepper.prefill()
    for _ in range(4):
        stepper.step()
    original, calls = linear_attention.gated_delta_step, []

    def interrupted(*args, **kwargs):
        calls.append(None)
        if len(calls) == 2:  # layer 1 of the first step built from here
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(linear_attention, "gated_delta_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stepper.step()
    monkeypatch.setattr(linear_attention, "gated_delta_step", original)
    assert_back_at_and_resumes(stepper, straight, len(PROMPT) + 4)
