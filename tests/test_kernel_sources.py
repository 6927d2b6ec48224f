"""The kernel sources in kernels/ compile and compute right without a GPU.

CI has no Apple GPU, so the Metal prelude plus the shared bodies are wrapped in the signature MLX's
metal_kernel would write and compiled as C++ against kernels/metal_cpu_shim.h (every supported
bits / group size / fold combination, float32 and bfloat16), then run on the CPU against the
reference. Where nvcc exists, the CUDA prelude plus the same bodies compile the way MLX's
cuda_kernel wraps them.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from itertools import product

import mlx.core as mx
import numpy as np
import pytest

from moebench.fused_kernel import DOWN, GATE_UP, KERNEL_DIR, Stage, kernel_source
from moebench.quant import QuantizedParts

GATE_UP_BITS, DOWN_BITS, GROUPS = (4, 8), (4, 6, 8), (32, 64, 128)
E, K, DIN, DFF = 4, 3, 256, 128  # DFF divides by every group size and by 16 (6-bit)
FLOAT_TYPES = {"x": "float", "gate_s": "ST", "gate_b": "ST", "up_s": "ST", "up_b": "ST", "down_s": "ST",
               "down_b": "ST", "scores": "S", "act": "float", "y": "float", "out": "T"}


def _template_params(stage: Stage) -> list[tuple[str, str]]:
    """(kind, name) in the order fused_kernel passes them (MLX emits `template <...>` in that order)."""
    params = [("typename", "ST")] if stage is GATE_UP else [("typename", "T"), ("typename", "ST"), ("typename", "S")]
    params += [("int", n) for n in ("E", "K", "DIN", "DFF", "GS", "BITS")]
    if stage is DOWN:
        params.append(("bool", "FOLD"))
    return params


def _metal_signature(stage: Stage, ctype: dict[str, str], sizes: dict[str, int]) -> str:
    """Parameters as MLX writes them: inputs under 8 elements live in `constant`, the rest in `device`."""
    params = []
    for name in stage.inputs:
        space = "constant" if sizes[name] < 8 else "device"
        params.append(f"const {space} {ctype.get(name, 'uint32_t')}* {name}")
    params += [f"device {ctype[name]}* {name}" for name in stage.outputs]
    return ",\n    ".join(params + ["uint3 thread_position_in_grid"])


def _metal_kernels(flavor: str, ctype: dict[str, str], instances: dict[Stage, list[list[str]]]) -> str:
    """A template kernel per stage for this dtype flavor, as MLX would write it, plus its instances."""
    sizes = {"indices": K, "scores": K}
    parts = []
    for stage in (GATE_UP, DOWN):
        _, source = kernel_source("metal", stage)
        tparams = ", ".join(f"{kind} {name}" for kind, name in _template_params(stage))
        parts.append(f"template <{tparams}>\nvoid {stage.name}_{flavor}(\n    "
                     f"{_metal_signature(stage, ctype, {n: sizes.get(n, 64) for n in stage.inputs})}) {{\n"
                     f"{source}\n}}")
        for args in instances[stage]:
            parts.append(f"template void {stage.name}_{flavor}<{', '.join(args)}>(" +
                         ", ".join([f"const {ctype.get(n, 'uint32_t')}*" for n in stage.inputs] +
                                   [f"{ctype[n]}*" for n in stage.outputs] + ["uint3"]) + ");")
    return "\n\n".join(parts)


def _all_instances(t: str) -> dict[Stage, list[list[str]]]:
    shape = [str(E), str(K), str(DIN), str(DFF)]
    return {
        GATE_UP: [[t, *shape, str(g), str(b)] for b, g in product(GATE_UP_BITS, GROUPS)],
        DOWN: [[t, t, "float", *shape, str(g), str(b), fold] for b, g, fold in
               product(DOWN_BITS, GROUPS, ("true", "false"))],
    }


def _run_entries() -> str:
    """extern "C" launchers for the float32 instances, one pair per (gate bits, down bits, group size)."""
    out = []
    for gb, db, g in _RUN_CASES:
        tag = f"{gb}_{db}_{g}"
        shape = f"{E}, {K}, {DIN}, {DFF}, {g}"
        out.append(
            f'extern "C" void run_gate_up_{tag}(const float* x, const uint32_t* idx, const uint32_t* gw, '
            f"const float* gs, const float* gb, const uint32_t* uw, const float* us, const float* ub, float* act, "
            f"uint rows) {{\n  mb_shim_launch(rows, {K}, [&](uint3 t) {{ "
            f"{GATE_UP.name}_f32<float, {shape}, {gb}>(x, idx, gw, gs, gb, uw, us, ub, act, t); }});\n}}")
        for fold in ("true", "false"):
            out.append(
                f'extern "C" void run_down_{tag}_{fold}(const uint32_t* idx, const float* sc, const uint32_t* dw, '
                f"const float* ds, const float* dbias, const float* act, float* y, float* o, uint rows) {{\n"
                f"  mb_shim_launch(rows, {1 if fold == 'true' else K}, [&](uint3 t) {{ "
                f"{DOWN.name}_f32<float, float, float, {shape}, {db}, {fold}>(idx, sc, dw, ds, dbias, act, y, o, t); "
                f"}});\n}}")
    return "\n\n".join(out)


_RUN_CASES = [(4, 4, 32), (8, 8, 64), (4, 6, 128), (8, 6, 32), (4, 8, 128)]


@pytest.fixture(scope="module")
def shim_library(tmp_path_factory) -> ctypes.CDLL:
    """The Metal sources built with g++ against the shim (fails the tests on any compile error)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    folder = tmp_path_factory.mktemp("shim")
    f32 = {n: "float" for n in FLOAT_TYPES}
    bf16 = {n: {"T": "bfloat16_t", "ST": "bfloat16_t", "S": "float"}.get(t, t) for n, t in FLOAT_TYPES.items()}
    header, _ = kernel_source("metal", GATE_UP)
    unit = "\n\n".join([
        f'#include "{KERNEL_DIR / "metal_cpu_shim.h"}"', header,
        _metal_kernels("f32", f32, _all_instances("float")),
        _metal_kernels("bf16", bf16, _all_instances("bfloat16_t")),
        _run_entries(),
    ])
    src, lib = folder / "fused_moe_metal_shim.cpp", folder / "libfusedmoe.so"
    src.write_text(unit)
    done = subprocess.run(["g++", "-std=c++20", "-O1", "-Wall", "-Werror", "-Wno-unused-variable",
                           "-Wno-unused-but-set-variable", "-fPIC", "-shared", "-pthread", str(src), "-o", str(lib)],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"Metal source does not compile under the shim:\n{done.stderr[-6000:]}"
    return ctypes.CDLL(str(lib))


def test_metal_source_compiles_for_every_supported_combination(shim_library):
    assert hasattr(shim_library, "run_gate_up_4_4_32")


def _quantized(rng: np.random.Generator, out_f: int, in_f: int, bits: int, group: int) -> QuantizedParts:
    w = mx.array(rng.standard_normal((E, out_f, in_f)).astype(np.float32) / np.sqrt(in_f))
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return QuantizedParts(q, s, b, group, bits, "affine")


def _ptr(a: np.ndarray):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("gate_bits,down_bits,group", _RUN_CASES)
def test_shimmed_metal_kernels_match_the_reference_on_cpu(shim_library, gate_bits, down_bits, group):
    from moebench.fused_kernel import combine, reference_expert_outputs

    rng = np.random.default_rng(gate_bits * 100 + down_bits * 10 + group)
    gate, up = (_quantized(rng, DFF, DIN, gate_bits, group) for _ in range(2))
    down = _quantized(rng, DIN, DFF, down_bits, group)
    x = rng.standard_normal(DIN).astype(np.float32)
    idx = np.array([2, 0, 3], dtype=np.uint32)
    scores = np.array([0.5, 0.3, 0.2], dtype=np.float32)
    host = {name: np.ascontiguousarray(np.array(a)) for name, a in (
        ("gw", gate.weight), ("gs", gate.scales), ("gb", gate.biases), ("uw", up.weight), ("us", up.scales),
        ("ub", up.biases), ("dw", down.weight), ("ds", down.scales), ("db", down.biases))}
    act = np.full((K, DFF), np.nan, dtype=np.float32)
    tag = f"{gate_bits}_{down_bits}_{group}"
    padded = lambda n: -(-n // 5) * 5  # noqa: E731 -- rows past the end must be skipped, not written
    getattr(shim_library, f"run_gate_up_{tag}")(
        _ptr(x), _ptr(idx), _ptr(host["gw"]), _ptr(host["gs"]), _ptr(host["gb"]), _ptr(host["uw"]),
        _ptr(host["us"]), _ptr(host["ub"]), _ptr(act), ctypes.c_uint(padded(DFF)))
    truth_y = np.array(reference_expert_outputs(mx.array(x), mx.array(idx), gate, up, down))
    truth_out = np.array(combine(mx.array(truth_y), mx.array(scores)))
    results = {}
    for fold in ("true", "false"):
        y = np.full((K, DIN), np.nan, dtype=np.float32)
        out = np.full(DIN + 1, -7.0, dtype=np.float32)  # one guard element past the end
        getattr(shim_library, f"run_down_{tag}_{fold}")(
            _ptr(idx), _ptr(scores), _ptr(host["dw"]), _ptr(host["ds"]), _ptr(host["db"]), _ptr(act), _ptr(y),
            _ptr(out), ctypes.c_uint(padded(DIN)))
        assert out[-1] == -7.0, "a padding row wrote past the end"
        nrms = np.sqrt(np.mean((y - truth_y) ** 2)) / np.sqrt(np.mean(truth_y**2))
        assert nrms < 1e-5, f"fold={fold}: shimmed kernel vs reference nRMS {nrms:.2e}"
        results[fold] = y
        if fold == "true":
            out_nrms = np.sqrt(np.mean((out[:-1] - truth_out) ** 2)) / np.sqrt(np.mean(truth_out**2))
            assert out_nrms < 1e-5, f"folded combine vs reference nRMS {out_nrms:.2e}"
    assert np.array_equal(results["true"], results["false"]), "fold must not change the per-expert outputs"


def _cuda_unit() -> str:
    """The CUDA prelude and bodies wrapped the way MLX's cuda_kernel does (constexpr template constants)."""
    header, _ = kernel_source("cuda", GATE_UP)
    ctype = {"T": "__nv_bfloat16", "ST": "__nv_bfloat16", "S": "float"}
    parts = ["#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"
             "#include <cuda/std/limits>\n#define inf cuda::std::numeric_limits<float>::infinity()", header,
             "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;"]
    cases = [(GATE_UP, b, g, None) for b, g in product(GATE_UP_BITS, GROUPS)]
    cases += [(DOWN, b, g, f) for b, g, f in product(DOWN_BITS, GROUPS, ("true", "false"))]
    for n, (stage, bits, group, fold) in enumerate(cases):
        _, source = kernel_source("cuda", stage)
        params = [f"const {ctype.get(FLOAT_TYPES.get(i, ''), FLOAT_TYPES.get(i, 'uint32_t'))}* {i}"
                  for i in stage.inputs]
        params += [f"{ctype.get(FLOAT_TYPES[o], FLOAT_TYPES[o])}* {o}" for o in stage.outputs]
        consts = "".join(f"  using {t} = {c};\n" for t, c in ctype.items() if stage is DOWN or t == "ST")
        consts += "".join(f"  constexpr int {k} = {v};\n" for k, v in
                          (("E", 60), ("K", 4), ("DIN", 2048), ("DFF", 1408), ("GS", group), ("BITS", bits)))
        consts += f"  constexpr bool FOLD = {fold};\n" if fold else ""
        parts.append(f"__global__ void {stage.name}_{n}({', '.join(params)}) {{\n{consts}\n{source}\n}}")
    parts.append("}  // namespace mlx::core::cu")
    return "\n\n".join(parts)


def test_cuda_source_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    src = tmp_path / "fused_moe.cu"
    src.write_text(_cuda_unit())
    done = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "fused_moe.o"),
                           "-Werror", "all-warnings"], capture_output=True, text=True)
    assert done.returncode == 0, f"CUDA source does not compile:\n{done.stderr[-6000:]}"
