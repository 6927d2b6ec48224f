"""Peak memory beyond what is held before of an eager `generate` (2 tokens after an N-token prompt), with MLX's
attention as it is (none) or replaced by a stub that returns the scaled queries (nosdpa):
python3 THIS CKPT N none|nosdpa."""

import sys

import mlx.core as mx

from moebench.checkpoint.loader import load
from moebench.decode.loop import generate

path, n, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model, _ = load(path)
prompt = [(i * 7) % 200 + 1 for i in range(n)]
if what == "nosdpa":
    mx.fast.scaled_dot_product_attention = lambda q, k, v, scale=1.0, mask=None, **_: q * scale
mx.synchronize()
mx.clear_cache()
mx.reset_peak_memory()
base = mx.get_active_memory()
generate(model, prompt, 2, compiled=False)
mx.synchronize()
print(what, n, f"{(mx.get_peak_memory() - base) / 1e6:.1f} MB")
