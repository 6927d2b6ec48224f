"""What every kernel wrapper shares: the backend this machine offers, the kernel sources (one body per stage
behind a thin per-backend prelude), the built kernel objects, and input checks run once per signature.

Backends: 'metal' and 'cuda' build JIT kernels from the sources in the top-level kernels/ folder (carried
inside the installed package as moebench/kernel_sources); 'reference' is the same arithmetic in MLX ops,
on any device: the test oracle and the CPU path.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import mlx.core as mx

from ..errors import UnsupportedKernelConfig
from ..models.args import QuantizedParts
from ..models.switch import on_main_thread

# The sources of the package this module belongs to: an earlier revision imported under another name (moebench
# bench --snapshot) reads its own kernels, not the installed package's.
KERNEL_DIR = Path(str(resources.files(__package__.rpartition(".")[0]) / "kernel_sources"))
LANES = 32  # threads of a simdgroup (Metal) or warp (CUDA)
GPU_BACKENDS = ("metal", "cuda")
BACKENDS = (*GPU_BACKENDS, "reference")
# Per backend: the header part of the prelude (helpers) and the source part (thread indices).
PRELUDES = {"metal": ("metal_header.h", "metal_indices.inc"), "cuda": ("cuda_header.cuh", "cuda_indices.inc")}
# Helpers some bodies call, after the backend's header part: the quantized formats, row loads and the experts'
# activation; the router's selection; the join of the decode attention's partials.
QUANT = "moe_quant.inc"
SELECT = "moe_select.inc"
JOIN = "attn_join.inc"
# The quantization modes the kernels read, by the MODE template constant they take (moe_quant.inc).
KERNEL_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")


def available_backend() -> str:
    """'metal' or 'cuda' when the default device is a GPU with that back-end, else 'reference' (CPU)."""
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        if mx.cuda.is_available():
            return "cuda"
    return "reference"


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise UnsupportedKernelConfig(f"unknown fused backend {backend!r} (metal, cuda or reference)")


@dataclass(frozen=True)
class Stage:
    """One kernel: its body file, its parameter names (MLX writes the signature) and the helper files it calls
    (QUANT, SELECT, JOIN)."""

    name: str
    body: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    helpers: tuple[str, ...] = ()


# A comment, or a string or character literal (kept whole: what looks like a comment inside one is not).
_COMMENT_OR_LITERAL = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)


def compact(code: str) -> str:
    """C++ or Metal source without its comments, indentation and blank lines. MLX hashes a custom kernel's whole
    source each time it encodes a launch (CustomKernel::eval_gpu, on CUDA and on Metal), so every byte of it is
    host time at every decode step; the files keep their comments for the people who read them."""
    code = _COMMENT_OR_LITERAL.sub(lambda m: m.group() if m.group()[0] in "\"'" else "", code)
    lines, continued = [], False
    for line in code.splitlines():
        line = line.strip()
        if line or continued:  # a line after a backslash belongs to its macro, empty or not
            lines.append(line)
        continued = line.endswith("\\")
    return "\n".join(lines) + "\n"


def kernel_header(backend: str, helpers: tuple[str, ...]) -> str:
    """The header part of `backend`'s prelude and the `helpers` files after it, compacted."""
    if backend not in PRELUDES:
        raise UnsupportedKernelConfig(f"no kernel prelude for backend {backend!r} (have {sorted(PRELUDES)})")
    return compact("".join((KERNEL_DIR / f).read_text() for f in (PRELUDES[backend][0], *helpers)))


def kernel_source(backend: str, stage: Stage) -> tuple[str, str]:
    """(header, source) for `stage` on `backend`: the backend's prelude and the stage's helpers around the shared
    body, compacted."""
    header = kernel_header(backend, stage.helpers)
    return header, compact((KERNEL_DIR / PRELUDES[backend][1]).read_text() + (KERNEL_DIR / stage.body).read_text())


_kernels: dict[tuple[str, str], object] = {}


def built_kernel(backend: str, stage: Stage):
    """The MLX kernel object of `stage` on `backend`, built once; MLX compiles once per template. Its name carries
    a digest of its source: MLX keeps compiled kernels by name, and another revision's kernels loaded beside these
    (a before/after bench in one process) would otherwise run whichever source was compiled first."""
    key = (backend, stage.name)
    if key not in _kernels:
        header, source = kernel_source(backend, stage)
        name = f"{stage.name}_{hashlib.sha256((header + source).encode()).hexdigest()[:12]}"
        if backend == "metal" and mx.metal.is_available():
            factory = mx.fast.metal_kernel
        elif backend == "cuda" and mx.cuda.is_available():
            factory = mx.fast.cuda_kernel
        else:
            raise UnsupportedKernelConfig(f"the {backend} back-end is not available in this MLX build")
        _kernels[key] = factory(name=name, input_names=list(stage.inputs), output_names=list(stage.outputs),
                                source=source, header=header)
    return _kernels[key]


_traced: dict[tuple, Callable] = {}


def run_compiled(fn: Callable, constants: tuple, *arrays) -> object:
    """fn(*arrays, *constants), on the main thread as one compiled graph traced once per `fn` and `constants`
    (hashable values fixed for a model and shape; `arrays`: arrays, or tuples of arrays and None), elsewhere op by
    op (moebench.models.switch.on_main_thread says why). The reference backend is many small MLX ops a layer, and
    on the CPU each costs a dispatch: compiled, its element-wise runs fuse (the results are the same bits)."""
    if not on_main_thread():
        return fn(*arrays, *constants)
    key = (fn, constants)
    if key not in _traced:
        _traced[key] = mx.compile(lambda *a: fn(*a, *constants))
    return _traced[key](*arrays)


class CheckedOnce:
    """Input checks of one kernel, run in Python before MLX sees the inputs (a bad launch aborts the process),
    and once per signature: a decode repeats one, and a check costs more than the launch's Python."""

    def __init__(self, check: Callable[..., None]):
        self._check = check
        self._seen: set[Hashable] = set()

    def __call__(self, key: Hashable, *args) -> None:
        if key not in self._seen:
            self._check(*args)
            self._seen.add(key)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def float_bits(v: float) -> int:
    """v's float32 bits as a signed int: how a float reaches a kernel (MLX's kernel templates take no floats)."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


def signature(a: mx.array | None) -> tuple | None:
    """An input's (shape, dtype), or None: what a kernel's checks are keyed by."""
    return None if a is None else (tuple(a.shape), a.dtype)


def parts_signature(p: QuantizedParts) -> tuple:
    """A quantized matrix's shapes, dtypes and format, as a kernel's checks are keyed by."""
    return (p.weight.shape, p.scales.shape, p.scales.dtype, p.biases is not None and p.biases.dtype, p.bits,
            p.group_size, p.mode)
