"""Microbenchmark of the routed-expert stack: the fused decode-MoE kernel pair against the fallback.

A stack of MoE layers at Qwen1.5-MoE-A2.7B shapes by default (24 layers, 60 experts, top-4, D 2048,
Dff 1408, 4-bit group 64, bfloat16), with random packed weights and a random routing per token and
layer that every arm replays. One sample decodes `tokens` single-token steps through the whole
stack (each layer's output feeds the next; one evaluation per step, as in decode), and the arms
are interleaved, in a rotating order, over `repeats` samples. Reported: per-step median and spread
per arm and the fallback / arm ratio from this one run. Absolute times mean something only on the
GPU they were measured on.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

import mlx.core as mx

from ..decode.sampling import check_seed
from ..errors import ConfigError
from ..execution import moe, support
from ..execution.kernel import GPU_BACKENDS, available_backend
from ..models.args import AFFINE_BITS, QuantizedParts
from ..models.switch import SwitchGLU
from .bench import rounds
from .flags import at_least, whole_number
from .json_option import add_json_option, check_json_target, report
from .progress import Progress
from .text_table import fitted, markdown_table


@dataclass(frozen=True)
class StackShape:
    layers: int = 24
    experts: int = 60
    top_k: int = 4
    hidden: int = 2048
    dff: int = 1408
    bits: int = 4
    group_size: int = 64
    dtype: str = "bfloat16"


SHAPE_FIELDS = ("layers", "experts", "top_k", "hidden", "dff", "bits", "group_size")  # each an integer >= 1
SHAPE_HELP = {"layers": "MoE layers in the stack", "experts": "routed experts per layer",
              "top_k": "experts each token is routed to", "hidden": "hidden size D",
              "dff": "expert width, moe_intermediate_size", "bits": "quantization bits of the expert weights",
              "group_size": "quantization group size of the expert weights"}


@dataclass(frozen=True)
class ArmResult:
    name: str
    median_ms: float
    min_ms: float
    max_ms: float
    build_median_ms: float
    samples_ms: list[float]
    ratio_vs_fallback: float
    paths: list[str]


def _random_parts(shape: StackShape, out_f: int, in_f: int, dtype: mx.Dtype) -> QuantizedParts:
    """Random packed words (every bit pattern is a valid affine code) and small random scales/biases."""
    words = in_f * shape.bits // 32
    groups = in_f // shape.group_size
    half_words = [mx.random.randint(0, 1 << 16, (shape.experts, out_f, words), dtype=mx.uint32) for _ in range(2)]
    weight = (half_words[0] << 16) | half_words[1]
    scales = (mx.random.normal((shape.experts, out_f, groups)) * (0.02 / (1 << shape.bits))).astype(dtype)
    biases = (mx.random.normal((shape.experts, out_f, groups)) * 0.01).astype(dtype)
    mx.eval(weight, scales, biases)
    return QuantizedParts(weight, scales, biases, shape.group_size, shape.bits, "affine")


def build_stack(shape: StackShape) -> list[SwitchGLU]:
    dtype = getattr(mx, shape.dtype)
    stack = []
    for _ in range(shape.layers):
        gate, up = (_random_parts(shape, shape.dff, shape.hidden, dtype) for _ in range(2))
        down = _random_parts(shape, shape.hidden, shape.dff, dtype)
        stack.append(SwitchGLU.from_parts(gate, up, down))
    return stack


def random_routing(shape: StackShape, tokens: int) -> tuple[mx.array, mx.array]:
    """Expert ids [tokens, layers, 1, K] (distinct per layer, uint32), softmax scores [.., 1, K] float32."""
    keys = mx.random.uniform(shape=(tokens, shape.layers, 1, shape.experts))
    ids = mx.argpartition(keys, kth=shape.top_k - 1, axis=-1)[..., : shape.top_k].astype(mx.uint32)
    scores = mx.softmax(mx.random.normal((tokens, shape.layers, 1, shape.top_k)), axis=-1)
    mx.eval(ids, scores)
    return ids, scores


@dataclass
class Arm:
    """One way of running the stack: `path` a fused backend or 'fallback', rows per threadgroup, compiled or not."""

    name: str
    path: str
    rows: int = moe.DEFAULT_ROWS
    compiled: bool = False
    _traced: object = None

    def step(self, stack: list[SwitchGLU], x: mx.array, ids: mx.array, scores: mx.array) -> mx.array:
        """One decode step through the stack; `compiled` replays an mx.compile trace (no Python graph build)."""
        if not self.compiled:
            return self._layers(stack, x, ids, scores)
        if self._traced is None:
            self._traced = mx.compile(lambda x, ids, scores: self._layers(stack, x, ids, scores))
        return self._traced(x, ids, scores)

    def _layers(self, stack: list[SwitchGLU], x: mx.array, ids: mx.array, scores: mx.array) -> mx.array:
        for layer, experts in enumerate(stack):
            x, _ = moe.routed_experts(self.path, experts, x, ids[layer], scores[layer], self.rows)
        return x


def _time_arm(arm: Arm, stack, x0, ids, scores) -> tuple[float, float]:
    """(ms per decode step, of which ms building the graph in Python), one evaluation per step."""
    build = total = 0.0
    for t in range(ids.shape[0]):
        start = time.perf_counter()
        out = arm.step(stack, x0, ids[t], scores[t])
        built = time.perf_counter()
        mx.eval(out)
        build += built - start
        total += time.perf_counter() - start
    return total * 1e3 / ids.shape[0], build * 1e3 / ids.shape[0]


def run(shape: StackShape, tokens: int = 16, repeats: int = 7, rows: list[int] | None = None,
        compiled: bool = False, seed: int = 0, progress: bool = True) -> dict:
    """Time the arms interleaved (with `progress`, under a bar on stderr); returns a JSON-ready dict (environment,
    shape, arms, dispatch counts)."""
    for name in SHAPE_FIELDS:  # a zero width or count reaches the kernels as a division by zero (SIGFPE)
        whole_number(getattr(shape, name), name)
    whole_number(repeats, "repeats")
    whole_number(tokens, "tokens")
    for r in rows or ():
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= moe.MAX_ROWS:
            raise ConfigError(f"rows {r!r}: rows per threadgroup must be integers from 1 to {moe.MAX_ROWS}")
    check_seed(seed)
    if shape.bits not in AFFINE_BITS or shape.hidden % shape.group_size or shape.dff % shape.group_size:
        raise ConfigError(f"stack {shape}: bits must be one of {AFFINE_BITS} and hidden and dff multiples of "
                          "group_size")
    if not 1 <= shape.top_k <= shape.experts:
        raise ConfigError(f"top_k {shape.top_k} must be between 1 and experts ({shape.experts})")
    mx.random.seed(seed)
    backend = available_backend()
    with Progress(desc="microbench", unit="run", disable=not progress) as bar:  # its line ended on an error
        bar.set_postfix_str("building the layer stack")
        stack = build_stack(shape)
        ids, scores = random_routing(shape, tokens)
        x0 = (mx.random.normal((1, shape.hidden)) * 0.5).astype(getattr(mx, shape.dtype))
        reason = support.experts_reason(stack[0].quantized_parts(), backend)
        fused = backend if reason is None else "fallback"  # the fused arms say so in their path when declined
        arms = [Arm("fallback", "fallback")]
        for r in (rows or [None]) if backend in GPU_BACKENDS else [None]:
            label = f"fused {backend}" + (f" rows={r}" if r is not None else "")
            arms.append(Arm(label, fused, r or moe.DEFAULT_ROWS))
        if compiled:
            arms += [Arm("fallback compiled", "fallback", compiled=True),
                     Arm(f"fused {backend} compiled", fused, compiled=True)]
        bar.reset(total=len(arms) * (repeats + 1))
        for arm in arms:  # warm up: JIT compiles, allocator pools
            bar.set_postfix_str(f"warm-up {arm.name}")
            _time_arm(arm, stack, x0, ids[:2], scores[:2])
            bar.update()
        samples: dict[str, list[tuple[float, float]]] = {a.name: [] for a in arms}
        for rep, arm in rounds(arms, repeats):
            bar.set_postfix_str(f"repeat {rep + 1} {arm.name}")
            samples[arm.name].append(_time_arm(arm, stack, x0, ids, scores))
            bar.update()
    base = statistics.median(t for t, _ in samples["fallback"])
    results = []
    for arm in arms:
        total = [t for t, _ in samples[arm.name]]
        paths = [arm.path if arm.path != "fallback" or arm.name.startswith("fallback") else f"fallback: {reason}"]
        results.append(ArmResult(arm.name, statistics.median(total), min(total), max(total),
                                 statistics.median(b for _, b in samples[arm.name]), total,
                                 base / statistics.median(total), paths))
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mlx": mx.__version__, "backend": backend, "device": _device_name(), "python": platform.python_version(),
        "shape": asdict(shape), "tokens_per_sample": tokens, "repeats": repeats,
        "arms": [asdict(r) for r in results],
    }


def _device_name() -> str:
    try:
        info = mx.device_info()
    except Exception:  # noqa: BLE001 -- a backend without device_info still gets benchmarked
        return str(mx.default_device())
    return str(info.get("device_name") or info.get("architecture") or mx.default_device())


def format_table(report: dict) -> str:
    """The shape and platform, then one row per arm (ms per step)."""
    s = report["shape"]
    rows = [["arm", "median", "min", "max", "build", "fallback/arm", "path"]]
    rows += [[a["name"], *(f"{a[k]:.3f}" for k in ("median_ms", "min_ms", "max_ms", "build_median_ms")),
              f"{a['ratio_vs_fallback']:.2f}x", ", ".join(a["paths"])] for a in report["arms"]]
    return "\n".join(fitted([
        f"routed-expert stack: {s['layers']} layers of {s['experts']} experts top-{s['top_k']}, D {s['hidden']}, Dff "
        f"{s['dff']}, {s['bits']}-bit g{s['group_size']}, {s['dtype']}; on {report['device']} ({report['backend']}), "
        f"MLX {report['mlx']}, {report['date']}",
        f"{report['repeats']} interleaved samples x {report['tokens_per_sample']} steps; ms per step",
        *markdown_table(rows)]))


def add_command(sub: argparse._SubParsersAction) -> None:
    """`moebench microbench`: fused vs fallback on the routed-expert stack (defaults: A2.7B shapes)."""
    p = sub.add_parser("microbench", help="time the fused decode-MoE kernels against gather_qmm on a layer stack")
    defaults = StackShape()
    for field_name in SHAPE_FIELDS:
        p.add_argument(f"--{field_name.replace('_', '-')}", type=at_least(1), default=getattr(defaults, field_name),
                       help=f"{SHAPE_HELP[field_name]} (default %(default)s, as Qwen1.5-MoE-A2.7B)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=defaults.dtype,
                   help="activation dtype, and of the scales and biases (default %(default)s)")
    p.add_argument("--tokens", type=at_least(1), default=16, help="decode steps per sample")
    p.add_argument("--repeats", type=at_least(1), default=7, help="interleaved samples per arm")
    p.add_argument("--rows", default=None, help="comma-separated rows per threadgroup to sweep (GPU)")
    p.add_argument("--compiled", action="store_true",
                   help="also time both paths replayed through mx.compile (GPU work without the Python graph build)")
    add_json_option(p, "the report (every sample's times)")
    p.set_defaults(run=_run_command)


def _run_command(a: argparse.Namespace) -> int:
    check_json_target(a.json)
    shape = StackShape(a.layers, a.experts, a.top_k, a.hidden, a.dff, a.bits, a.group_size, a.dtype)
    try:
        rows = [int(r) for r in a.rows.split(",")] if a.rows else None
    except ValueError:
        raise ConfigError(f"--rows {a.rows!r}: expected comma-separated integers") from None
    record = run(shape, a.tokens, a.repeats, rows, a.compiled)
    record["command"] = " ".join(sys.argv)
    report(a.json, format_table(record), record)
    return 0


if __name__ == "__main__":  # `python -m moebench.tools.microbench ...`: the same options without the other subcommands
    parser = argparse.ArgumentParser(prog="python -m moebench.tools.microbench")
    add_command(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["microbench", *sys.argv[1:]])
    sys.exit(parsed.run(parsed))
