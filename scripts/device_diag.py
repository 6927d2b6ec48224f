"""Device diagnostics of issue 8 (a script, not part of the package): where a decode token's time goes.

    python3 scripts/device_diag.py CKPT micro          decode-attention kernel vs MLX's rope + sdpa path
    python3 scripts/device_diag.py CKPT decode ARMS    decode tok/s of generate() arms, interleaved, 3 rounds
    python3 scripts/device_diag.py CKPT kernels        GPU time per decode token by kernel (compiled fused step)
    python3 scripts/device_diag.py CKPT timeline [TRACE.json]   generate's host ranges and GPU kernels on one clock
    python3 scripts/device_diag.py TRACE.json.gz trace [TOKENS]  a timeline trace's kernels and CUDA calls per token

micro: 200 calls built, then evaluated at once (per-call time with launches amortised), at positions
64, 128 and 192 of a 256-slot cache, Qwen1.5-MoE-A2.7B attention (16 heads of 128), bf16.
ARMS (comma-separated): fused, fused-compiled, fused-noattn, fused-noattn-compiled, off, off-compiled,
mlxlm (mlx-lm's model under moebench's loop); noattn keeps the decode-attention kernel off while the MoE
kernels run (KernelSettings.attention_kernel); aheadN queues N steps ahead of the token read instead of
generate's default (ahead1: mlx-lm's depth; mlxlm-ahead1 too). Run it under different MLX_* settings
(say MLX_MAX_OPS_PER_BUFFER) in separate processes: MLX reads them once.
kernels: torch.profiler (CUPTI) records every CUDA kernel of the process, MLX's included, over 64
compiled fused decode steps after a 64-token prompt (an 8-token one until step 10: it hid how the
attention kernel's time grew with the positions): GPU time per token by kernel name against the loop's
wall time per token, the union of kernel intervals (MLX's CUDA graphs run independent kernels at once,
so the sum can exceed it), and the CPU time a compiled step takes to build and dispatch (torch is on the
device image, not a moebench dependency).
timeline: generate itself (compiled fused, 96 tokens) under torch.profiler with its host work marked
(building a step, async_eval, the rest: reading the token and queueing): the GPU's idle time per token
and what the host was doing during it; TRACE.json, when given, gets the Chrome trace.
DIAG_PROMPT_TOKENS=N sets the prompt of decode, kernels and timeline (default 64).
trace: reads such a trace (anywhere, no GPU needed): GPU time per token by kernel and launch shape (grid,
block), and the host's time per token in each CUDA runtime call, over TOKENS (96, timeline's count; the
prompt's kernels are counted in too).
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import re
import statistics
import sys
import time

import mlx.core as mx

from moebench.checkpoint.loader import load
from moebench.decode.compiled import CompiledForward
from moebench.decode.loop import STEPS_AHEAD, generate, generate_tokens
from moebench.execution.attention import decode_attention, rope_frequencies
from moebench.execution.executor import executor, fused_moe
from moebench.execution.settings import KernelSettings
from moebench.models.declare import AttentionSpec
from moebench.tools.bench import mlx_lm_model

CALLS = 200


def micro() -> None:
    heads, cap = AttentionSpec(16, 16, 128, qkv_bias=True), 256
    for p in (64, 128, 192):
        qkvs = [mx.random.normal((1, 1, heads.width)).astype(mx.bfloat16) for _ in range(CALLS)]
        bias = mx.random.normal((heads.width,)).astype(mx.bfloat16)
        keys, values = (mx.random.normal((1, 16, cap, 128)).astype(mx.bfloat16) for _ in range(2))
        inv, slots = rope_frequencies(128, 1e6), mx.array([p, cap], mx.int32)
        mx.eval(qkvs, bias, keys, values, inv, slots)

        def kernel(p=p, bias=bias, keys=keys, values=values, inv=inv, slots=slots, qkvs=qkvs):
            return [decode_attention("cuda", q, bias, inv, slots, keys, values, heads)[0] for q in qkvs]

        def mlx_path(p=p, bias=bias, keys=keys, values=values, qkvs=qkvs):
            outs = []
            for q in qkvs:
                x = (q + bias).reshape(1, 1, 48, 128).transpose(0, 2, 1, 3)
                rope = [mx.fast.rope(x[:, a:b], 128, traditional=False, base=1e6, scale=1.0, offset=p)
                        for a, b in ((0, 16), (16, 32))]
                k = mx.concatenate([keys[:, :, :p], rope[1]], axis=2)
                v = mx.concatenate([values[:, :, :p], x[:, 32:]], axis=2)
                outs.append(mx.fast.scaled_dot_product_attention(rope[0], k, v, scale=128**-0.5))
            return outs

        for name, fn in (("kernel", kernel), ("mlx", mlx_path)):
            times = []
            for _ in range(5):
                outs = fn()
                mx.synchronize()
                start = time.perf_counter()
                mx.eval(outs)
                times.append(1e6 * (time.perf_counter() - start) / CALLS)
            print(f"micro P={p} {name}: {statistics.median(times):.1f} us per call (eval of {CALLS} calls)", flush=True)


def ahead(arm: str) -> int:
    """Steps queued ahead in an arm: aheadN in its name, else generate's default."""
    found = re.search(r"ahead(\d+)", arm)
    return int(found.group(1)) if found else STEPS_AHEAD


def diag_prompt() -> list[int]:
    """The prompt decode, kernels and timeline start from: DIAG_PROMPT_TOKENS ids (default 64), so a kernel's time
    can be read at a long context too."""
    return [100 + i % 1000 for i in range(int(os.environ.get("DIAG_PROMPT_TOKENS", "64")))]


def decode(ckpt: str, arms: list[str]) -> None:
    model, _ = load(ckpt)
    other = mlx_lm_model(ckpt)[0] if any(a.startswith("mlxlm") for a in arms) else None
    prompt = diag_prompt()

    ex = executor(model)

    def run(name: str) -> float:
        if name.startswith("mlxlm"):
            return generate(other, prompt, 128, ahead=ahead(name)).decode_tps
        ex.settings = KernelSettings(fused=not name.startswith("off"), attention_kernel="noattn" not in name)
        return generate(model, prompt, 128, compiled="compiled" in name, ahead=ahead(name)).decode_tps

    for a in arms:
        run(a)  # warm-up (traces a compiled step)
    results = {a: [] for a in arms}
    for r in range(3):
        for a in arms[r % len(arms):] + arms[: r % len(arms)]:
            results[a].append(run(a))
    ops = os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default")
    for a in arms:
        print(f"decode ops={ops} {a}: median {statistics.median(results[a]):.1f} tok/s "
              f"{[round(v, 1) for v in results[a]]}", flush=True)


def kernels(ckpt: str, steps: int = 64) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    model, _ = load(ckpt)
    prompt = diag_prompt()
    with fused_moe(True):
        generate(model, prompt, 16, compiled=True)  # traces the step
        dispatch(model, prompt, steps)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            result = generate(model, prompt, steps + 1, compiled=True)
    wall_us = 1e6 / result.decode_tps
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    busy = sum(e.device_time_total for e in rows) / steps  # us per token (the 8-token prefill included)
    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == DeviceType.CUDA)
    deepest, running = 0, []
    for a, b in spans:  # the most kernels that ever run at once
        running = [e for e in running if e > a] + [b]
        deepest = max(deepest, len(running))
    covered = sum(b - a for a, b in union(spans))  # the time at least one kernel runs
    print(f"kernels: {steps} compiled fused decode steps; wall {wall_us:.0f} us/token (profiled), "
          f"kernel time summed {busy:.0f} us/token ({100 * busy / wall_us:.0f}%), GPU busy (union of kernel "
          f"intervals) {covered / 1e3 / steps:.0f} us/token, up to {deepest} kernels at once", flush=True)
    for e in rows[:30]:
        print(f"  {e.device_time_total / steps:8.1f} us/token  {e.count / steps:6.1f} launches/token  "
              f"{e.device_time_total / max(e.count, 1):7.2f} us each  {e.key[:90]}", flush=True)


def dispatch(model, prompt: list[int], steps: int) -> None:
    """CPU time a compiled step takes to build and to hand to the GPU, against the wall time per token: a
    step whose CPU side takes most of the wall time is bound by the CPU, however fast its kernels."""
    ex = executor(model)
    compiled = CompiledForward(ex, len(prompt) + 2 * steps + 1)

    def forward(tokens: mx.array) -> mx.array:
        return compiled(tokens, ex.settings)[0]

    token = mx.argmax(forward(mx.array(prompt, dtype=mx.uint32)))
    mx.eval(token)
    build, handed = [], []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        token = mx.argmax(forward(token.reshape(1).astype(mx.uint32)))
        t1 = time.perf_counter()
        mx.async_eval(token)
        build.append(t1 - t0)
        handed.append(time.perf_counter() - t1)
    mx.eval(token)
    wall = (time.perf_counter() - start) / steps
    print(f"dispatch: {steps} compiled steps queued without waiting: wall {1e6 * wall:.0f} us/token; CPU "
          f"build {1e6 * statistics.median(build):.0f} us, async_eval {1e6 * statistics.median(handed):.0f} us "
          f"(medians; async_eval max {1e6 * max(handed):.0f} us)", flush=True)
    handed, waited = [], []  # one step at a time: nothing in flight, so async_eval's time is the CPU's alone
    for _ in range(steps):
        token = mx.argmax(forward(token.reshape(1).astype(mx.uint32)))
        t0 = time.perf_counter()
        mx.async_eval(token)
        t1 = time.perf_counter()
        mx.eval(token)
        handed.append(t1 - t0)
        waited.append(time.perf_counter() - t1)
    print(f"dispatch: one step at a time: async_eval {1e6 * statistics.median(handed):.0f} us (the CPU's encoding), "
          f"then {1e6 * statistics.median(waited):.0f} us until the token is ready (medians)", flush=True)


def timeline(ckpt: str, trace: str | None, tokens: int = 96) -> None:
    """generate itself (compiled fused step, 64-token prompt) under torch.profiler, host ranges and GPU
    kernels on one clock: where the GPU sits idle, and what the host is doing meanwhile."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    model, _ = load(ckpt)
    prompt = diag_prompt()
    real_call, real_async = CompiledForward.__call__, mx.async_eval

    def traced_call(self: CompiledForward, tokens: mx.array, settings: KernelSettings):
        with record_function("host.build"):
            return real_call(self, tokens, settings)

    def traced_async(*arrays: mx.array) -> None:
        with record_function("host.async_eval"):
            real_async(*arrays)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if mx.cuda.is_available() else [])
    CompiledForward.__call__, mx.async_eval = traced_call, traced_async
    try:
        with fused_moe(True):
            generate(model, prompt, 16, compiled=True)  # traces the step
            with profile(activities=activities) as prof:
                steps = generate_tokens(model, prompt, tokens, compiled=True)
                while True:  # host.next: everything generate does for one token (build, async_eval, reading it)
                    with record_function("host.next"):
                        if next(steps, None) is None:
                            break
    finally:
        CompiledForward.__call__, mx.async_eval = real_call, real_async
    if trace:
        prof.export_chrome_trace(trace)
    events = list(prof.profiler.kineto_results.events())
    host = {n: [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == n]
            for n in ("host.next", "host.build", "host.async_eval")}
    gpu = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.device_type() == DeviceType.CUDA)
    nexts = host["host.next"][2:]  # the first two include the prompt's forward
    window = (nexts[0][0], nexts[-1][1])
    per = 1e3 * len(nexts)  # ns -> us per token
    busy = union([(max(a, window[0]), min(b, window[1])) for a, b in gpu if b > window[0] and a < window[1]])
    idle = complement(busy, window)
    spent = {n: overlap(union(host[n]), [window]) for n in host}
    print(f"timeline: {len(nexts)} tokens of generate (ahead {STEPS_AHEAD}); wall {(window[1] - window[0]) / per:.0f} "
          f"us/token; host in build {spent['host.build'] / per:.0f}, async_eval {spent['host.async_eval'] / per:.0f}, "
          f"the rest of generate (reading the token, queueing) "
          f"{(spent['host.next'] - spent['host.build'] - spent['host.async_eval']) / per:.0f} us/token", flush=True)
    if not gpu:
        print("timeline: no GPU kernels recorded (CUPTI needs CUDA)", flush=True)
        return
    idle_total = sum(b - a for a, b in idle)
    during = {n: overlap(idle, union(host[n])) for n in host}
    print(f"timeline: GPU busy {sum(b - a for a, b in busy) / per:.0f} us/token, idle {idle_total / per:.0f} us/token "
          f"in {len(idle)} gaps (largest {max((b - a for a, b in idle), default=0) / 1e3:.0f} us); idle while the host "
          f"builds {during['host.build'] / per:.0f}, encodes {during['host.async_eval'] / per:.0f}, waits or queues "
          f"{(during['host.next'] - during['host.build'] - during['host.async_eval']) / per:.0f}, is outside generate "
          f"{(idle_total - during['host.next']) / per:.0f} us/token", flush=True)


def union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged intervals."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def complement(spans: list[tuple[int, int]], window: tuple[int, int]) -> list[tuple[int, int]]:
    """The gaps of merged `spans` within `window`."""
    gaps, at = [], window[0]
    for a, b in spans:
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    return gaps + ([(at, window[1])] if at < window[1] else [])


def overlap(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> int:
    """Total length of the intersection of two merged interval lists."""
    total, i, j = 0, 0, 0
    while i < len(x) and j < len(y):
        total += max(0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace(path: str, tokens: int = 96, rows: int = 20) -> None:
    """Kernels by name and launch shape, and CUDA runtime calls, per token of a timeline trace."""
    events = json.load(gzip.open(path) if path.endswith(".gz") else open(path))["traceEvents"]
    for category, title in (("kernel", "kernels"), ("cuda_runtime", "CUDA runtime calls (host)")):
        total: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
            if e.get("cat") == category:
                a = e.get("args", {})
                shape = f" grid {a.get('grid')} block {a.get('block')}" if category == "kernel" else ""
                key = e["name"][:70] + shape
                total[key][0] += 1
                total[key][1] += e["dur"]
        print(f"trace {path}: {title}, per token of {tokens}", flush=True)
        for key, (n, us) in sorted(total.items(), key=lambda kv: -kv[1][1])[:rows]:
            print(f"  {us / tokens:8.1f} us/token  {n / tokens:6.1f} /token  {us / n:8.2f} us each  {key}", flush=True)


if __name__ == "__main__":
    if sys.argv[2] == "micro":
        micro()
    elif sys.argv[2] == "kernels":
        kernels(sys.argv[1])
    elif sys.argv[2] == "timeline":
        timeline(sys.argv[1], sys.argv[3] if len(sys.argv) > 3 else None)
    elif sys.argv[2] == "trace":
        trace(sys.argv[1], *map(int, sys.argv[3:4]))
    else:
        decode(sys.argv[1], sys.argv[3].split(","))
