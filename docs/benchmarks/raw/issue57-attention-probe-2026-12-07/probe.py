"""Where the decode-attention kernel's fixed ~20 us a call goes (issue 57; a diagnostic, not part of the package).

Each arm is kernels/attn_decode.body with one part cut out or changed by a text edit, built as its own MLX CUDA
kernel and called as moebench calls it (moebench.execution.attention.gpu_decode_attention), at Qwen3-30B-A3B's
shape over a cache of 48 layers. torch.profiler (CUPTI) gives each launch's GPU time; the table is the median a
launch over the rounds, arms interleaved. Arms that keep the arithmetic are checked against the unedited kernel.

    python3 probe.py [--positions 100 2048] [--cap 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx
import numpy as np

from moebench.execution import attention
from moebench.execution.kernel import compact, kernel_source
from moebench.models.declare import AttentionSpec

ROTATE = "for (int i = 0; i <= GROUP; ++i) {\n  float x[PER];"
WALK_HEADS = "  for (int i = 0; i < GROUP; ++i) {\n    float s[BLOCK];"
COMBINE = "for (int i = 0; i < GROUP; ++i) {\n  const uint32_t h = g * uint32_t(GROUP) + uint32_t(i);"
PARTNER_READ = "other[jp[j]] * sn[j]"
PARTNER_SELECT = ("[&]() { float o = other[0]; for (int jj = 1; jj < PER; ++jj) { o = jj == int(jp[j]) ? other[jj] "
                  ": o; } return o; }() * sn[j]")
PROLOGUE_END = "if (split == 0 && w == 0) {"
# name: (edits (old, new), keeps the arithmetic, attention-module constants set for the arm)
ARMS = {
    "base": ((), True, {}),
    "empty": ((("if (g >= uint32_t(KV)) {", "if (true) {"),), False, {}),
    "prologue": (((PROLOGUE_END, "if (P >= 0) { return; }\n" + PROLOGUE_END),), False, {}),
    "notrig": ((("c[j] = mb_cos(theta);", "c[j] = 1.0f + 0.0f * theta;"),
                ("sn[j] = first ? -mb_sin(theta) : mb_sin(theta);", "sn[j] = 0.0f * theta;")), False, {}),
    "nowalk": ((("t0 < stop; t0 += WB)", "t0 < start; t0 += WB)"),), False, {}),
    "combine1": (((COMBINE, COMBINE.replace("i < GROUP", "i < 1")),), False, {}),
    "unroll": (((ROTATE, "MB_UNROLL " + ROTATE), (WALK_HEADS, "  MB_UNROLL\n" + WALK_HEADS),
                (PARTNER_READ, PARTNER_SELECT), (COMBINE, "MB_UNROLL " + COMBINE)), True, {}),
    "nocombine_nowalk": ((("t0 < stop; t0 += WB)", "t0 < start; t0 += WB)"),
                          (COMBINE, COMBINE.replace("i < GROUP", "i < 0"))), False, {}),
    "S1": ((), True, {"splits": lambda capacity, kv_heads: 1}),
    "W2": ((), True, {"WARPS_PER_HEAD": 2}),
}


def variant_kernel(name: str, edits):
    header, source = kernel_source("cuda", attention.ATTENTION)
    for old, new in edits:  # in the compacted text MLX receives
        old, new = compact(old).strip(), compact(new).strip()
        assert source.count(old) == 1, f"{name}: edit target not found once: {old[:40]!r}"
        source = source.replace(old, new)
    return mx.fast.cuda_kernel(name=f"probe_{name}", input_names=list(attention.ATTENTION.inputs),
                               output_names=list(attention.ATTENTION.outputs), source=source, header=header)


def main() -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    p = argparse.ArgumentParser()
    p.add_argument("--positions", type=int, nargs="+", default=[100, 2048])
    p.add_argument("--cap", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=48)
    a = p.parse_args()
    heads, layers = AttentionSpec(32, 4, 128), 48
    kernels = {n: variant_kernel(n, e) for n, (e, _, _) in ARMS.items()}
    rng = np.random.default_rng(0)
    keys = mx.random.normal((layers, 4, a.cap, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    values = mx.random.normal((layers, 4, a.cap, 128), key=mx.random.key(2)).astype(mx.bfloat16)
    qkv = mx.array(rng.standard_normal((1, heads.width)), dtype=mx.bfloat16)
    inv = attention.rope_frequencies(128, 1e6)
    norm = attention.QKNorm(mx.ones((128,), mx.bfloat16), mx.ones((128,), mx.bfloat16), 1e-6)
    mx.eval(keys, values, qkv)
    original = attention.built_kernel
    print(f"mlx {mx.__version__}; {mx.device_info().get('device_name', '')}; cap {a.cap}; splits "
          f"{attention.splits(a.cap, 4)}; {a.calls} calls a round, {a.rounds} rounds; GPU us a launch (CUPTI)")
    for pos in a.positions:
        slots = mx.array([pos, a.cap], mx.int32)

        def run(name: str, calls: int, slots: mx.array = slots) -> list[mx.array]:
            attention.built_kernel = lambda backend, stage: kernels[name] if stage is attention.ATTENTION else \
                original(backend, stage)
            saved = {k: getattr(attention, k) for k in ARMS[name][2]}
            for k, v in ARMS[name][2].items():
                setattr(attention, k, v)
            try:
                outs = [attention.gpu_decode_attention("cuda", qkv, None, inv, slots, keys, values, heads, i % layers,
                                                       qk_norm=norm)[0] for i in range(calls)]
            finally:
                attention.built_kernel = original
                for k, v in saved.items():
                    setattr(attention, k, v)
            mx.eval(outs)
            return outs

        base = np.array(run("base", 1)[0].astype(mx.float32))
        for name, (_, exact, _) in ARMS.items():
            got = np.array(run(name, 1)[0].astype(mx.float32))
            if exact:
                print(f"  P={pos} {name}: max |diff| against base {np.abs(got - base).max():.3g}")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for r in range(a.rounds):
                names = list(ARMS)
                for name in names[r % len(names):] + names[: r % len(names)]:
                    run(name, a.calls)
        times: dict[str, list[float]] = {}
        for e in prof.profiler.kineto_results.events():
            if e.device_type() == DeviceType.CUDA:
                times.setdefault(e.name(), []).append(e.duration_ns() / 1e3)
        print(f"P={pos}:")
        for kname, ts in sorted(times.items(), key=lambda kv: kv[0]):
            label = next((n for n in ARMS if f"probe_{n}_" in kname or kname.endswith(f"probe_{n}")), None)
            label = label or kname[:60]
            print(f"  {label:>18}: {statistics.median(ts):7.2f} us [{min(ts):.2f}-{max(ts):.2f}] x{len(ts)}  "
                  f"{kname[:70]}")


if __name__ == "__main__":
    main()
