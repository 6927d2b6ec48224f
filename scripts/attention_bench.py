"""Decode attention alone on a GPU: this revision's kernel against an earlier revision's (a snapshot folder, as
`moebench bench --snapshot` takes) and MLX's own scaled_dot_product_attention (what mlx-lm's decode runs after its
RoPE and cache update), at real model shapes and context lengths.

Each call is one layer's decode step over a cache of every layer (one buffer, the layer rotating call by call as
a decode walks them), so a short context is not served from L2 more than in a real step. A round times CALLS
calls of each arm, arms interleaved; the table gives per call the median [min-max] over the rounds and the key
and value bytes the call must read over that time.

    python3 scripts/attention_bench.py [--snapshot .snap/before] [--rounds 7] [--contexts 2048 16384 32768]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from moebench.execution import attention
from moebench.models.declare import AttentionSpec

# (name, heads, layers, bias, q/k norm)
SHAPES = (("qwen3-30b-a3b", AttentionSpec(32, 4, 128), 48, False, True),
          ("qwen1.5-moe-a2.7b", AttentionSpec(16, 16, 128), 24, True, False))
CALLS = 48


def load_snapshot(root: Path):
    """The earlier revision's moebench.execution.attention, imported as a package of its own name."""
    init = root / "moebench" / "__init__.py"
    spec = importlib.util.spec_from_file_location("moebench_snapshot", init, submodule_search_locations=[str(root /
                                                                                                            "moebench")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["moebench_snapshot"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("moebench_snapshot.execution.attention")


def arms_for(heads: AttentionSpec, layers: int, bias: bool, qknorm: bool, context: int, modules: dict):
    """{arm: call(layer) -> outputs} over one cache buffer of `layers` layers with `context` positions filled."""
    rng = np.random.default_rng(context)
    h, kv, hd = heads.n_heads, heads.n_kv_heads, heads.head_dim
    cap = context + 256
    keys = mx.random.normal((layers, kv, cap, hd), key=mx.random.key(1)).astype(mx.bfloat16)
    values = mx.random.normal((layers, kv, cap, hd), key=mx.random.key(2)).astype(mx.bfloat16)
    qkv = mx.array(rng.standard_normal((1, (h + 2 * kv) * hd)), dtype=mx.bfloat16)
    b = mx.array(rng.standard_normal(((h + 2 * kv) * hd,)) * 0.1, dtype=mx.bfloat16) if bias else None
    inv = 1.0 / (1e6 ** (mx.arange(0, hd, 2, dtype=mx.float32) / hd))
    slots = mx.array([context, cap], dtype=mx.int32)
    norm_w = mx.ones((hd,), mx.bfloat16)
    q = mx.array(rng.standard_normal((1, h, 1, hd)), dtype=mx.bfloat16)
    mx.eval(keys, values, qkv, inv, slots, norm_w, q, *([b] if bias else []))
    arms = {}
    for name, module in modules.items():
        norm = module.QKNorm(norm_w, norm_w, 1e-6) if qknorm else None
        arms[name] = (lambda m, n: lambda layer: m.gpu_decode_attention(
            "cuda", qkv, b, inv, slots, keys, values, heads, layer, qk_norm=n)[0])(module, norm)

    def sdpa(layer: int) -> mx.array:
        k = keys[layer : layer + 1, :, :context]
        v = values[layer : layer + 1, :, :context]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=hd**-0.5)

    arms["mlx sdpa"] = sdpa
    return arms


def time_arm(call, layers: int) -> float:
    """Seconds a call, over CALLS calls queued together (each on the next layer's cache)."""
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval([call(i % layers) for i in range(CALLS)])
    mx.synchronize()
    return (time.perf_counter() - t0) / CALLS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshot", type=Path, default=None, help="an earlier revision's folder (moebench/ and kernels/)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, arms interleaved (default 7)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 16384, 32768],
                   help="cached positions (default 2048 4096 16384 32768)")
    a = p.parse_args()
    if not mx.cuda.is_available():
        sys.exit("attention_bench: needs MLX's CUDA back-end")
    modules = {"this revision": attention}
    if a.snapshot is not None:
        modules["snapshot"] = load_snapshot(a.snapshot)
    print(f"mlx {mx.__version__}; {mx.device_info().get('device_name', '')}; {CALLS} calls a round, "
          f"{a.rounds} rounds, arms interleaved; us a call median [min-max]; TB/s: K+V bytes read / median time")
    for name, heads, layers, bias, qknorm in SHAPES:
        for context in a.contexts:
            arms = arms_for(heads, layers, bias, qknorm, context, modules)
            for call in arms.values():  # warm-up: compile, first touch
                time_arm(call, layers)
            times = {arm: [] for arm in arms}
            for _ in range(a.rounds):
                for arm, call in arms.items():
                    times[arm].append(time_arm(call, layers))
            kv_bytes = 2 * heads.n_kv_heads * context * heads.head_dim * 2
            splits = attention.splits(attention.attended(heads, context + 256), heads.n_kv_heads)
            print(f"\n{name} {heads.n_heads}/{heads.n_kv_heads}x{heads.head_dim}, context {context} "
                  f"({kv_bytes / 1e6:.1f} MB of K+V a layer; this revision: {splits} splits a key/value head)")
            for arm, ts in times.items():
                med = statistics.median(ts)
                print(f"  {arm:>14}: {med * 1e6:8.1f} us [{min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f}]  "
                      f"{kv_bytes / med / 1e12:5.2f} TB/s")
            del arms
            mx.clear_cache()


if __name__ == "__main__":
    main()
