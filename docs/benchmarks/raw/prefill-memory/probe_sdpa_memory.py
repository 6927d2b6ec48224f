"""The peak memory of one prefill chunk's attention (MLX's scaled_dot_product_attention, causal) at a hybrid's
full-attention shapes, by how its keys arrive: a contiguous array (moebench's static cache joins the known
slots and the chunk's) or a slice of a larger buffer (mlx-lm's KVCache), and in which dtype.

    python probe_sdpa_memory.py [--heads 16] [--kv-heads 2] [--head-dim 256] [--chunk 2048] [--keys 2048,8192]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

GB = 1e9


def peak(fn) -> float:
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return (mx.get_peak_memory() - before) / GB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--keys", default="2048,8192")
    a = p.parse_args()
    rows = []
    for dtype in (mx.bfloat16, mx.float32):
        for keys in map(int, a.keys.split(",")):
            q = mx.random.normal((1, a.chunk, a.heads, a.head_dim)).astype(dtype).transpose(0, 2, 1, 3)
            k = mx.random.normal((1, a.kv_heads, keys, a.head_dim)).astype(dtype)
            v = mx.random.normal((1, a.kv_heads, keys, a.head_dim)).astype(dtype)
            buffer_k = mx.zeros((1, a.kv_heads, keys + 256, a.head_dim), dtype)
            buffer_v = mx.zeros_like(buffer_k)
            buffer_k[..., :keys, :] = k
            buffer_v[..., :keys, :] = v
            mx.eval(q, k, v, buffer_k, buffer_v)
            scale = a.head_dim ** -0.5
            for how, kk, vv in (("contiguous", k, v), ("buffer slice", buffer_k[..., :keys, :],
                                                        buffer_v[..., :keys, :])):
                gb = peak(lambda q=q, kk=kk, vv=vv, scale=scale: mx.fast.scaled_dot_product_attention(
                    q, kk, vv, scale=scale, mask="causal"))
                rows.append({"dtype": str(dtype), "keys": keys, "how": how, "peak_gb": round(gb, 3)})
                print(rows[-1], flush=True)
            scores = a.heads * a.chunk * keys * dtype.size / GB
            print(f"  one [heads, chunk, keys] score matrix in {dtype}: {scores:.3f} GB", flush=True)
    print(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()), "rows": rows}))


if __name__ == "__main__":
    main()
