"""Round 6's mxfp8 fault, step by step: the float checkpoint, mlx_lm's mxfp8 conversion, the load, then
generations of 1, 3 and 12 tokens (1 is the prefill alone), MLX's ops first and then the fused kernels, with a
synchronisation after each, so the first step that faults is named. Run from a package root (this revision's or
a snapshot's): python3 probe_mxfp8.py MODE [MODE...]."""
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from moebench.checkpoint.loader import load
from moebench.decode.loop import generate
from moebench.execution.executor import executor, fused_moe
from moebench.tools.drift import make_variant
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint

t0 = time.time()


def step(name: str) -> None:
    mx.synchronize()
    print(f"{time.time() - t0:7.1f}s ok {name}", flush=True)


for mode in sys.argv[1:]:
    tmp = Path(tempfile.mkdtemp())
    cfg = qwen2_moe_config(num_hidden_layers=3)
    float_folder = write_random_checkpoint(tmp / "float", cfg, seed=3, dtype=mx.bfloat16)
    step(f"{mode}: float checkpoint")
    folder = make_variant(float_folder, mode, tmp)
    step(f"{mode}: mlx_lm conversion")
    model, _ = load(folder)
    mx.eval(model.parameters())
    step(f"{mode}: load")
    ex = executor(model)
    for on in (False, True):  # MLX's ops alone first; 1 token is the prefill alone, 3 adds two decode steps
        for n in (1, 3, 12):
            with fused_moe(on, model):
                ids = generate(model, [1, 2, 3, 4, 5], n).token_ids
            step(f"{mode}: generate fused={on} {n} tokens {ids}")
    print(mode, ex.dispatch()["moe"], flush=True)
