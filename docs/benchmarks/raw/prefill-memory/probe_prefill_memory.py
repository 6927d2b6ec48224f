"""Where a long prompt's prefill peak goes: moebench's compiled-path prefill and mlx-lm's generate_step prefill
on one checkpoint, first whole (the peak beyond what was held before), then with every decoder layer evaluated
on its own so each layer's peak is read (that changes what runs: an unhooked prefill never computes the parts of
the last layer no cache needs).

    python probe_prefill_memory.py CKPT PROMPT_TOKENS [--arms moebench,mlx-lm] [--hooked] [--dtype bfloat16]

moebench loads float32 on the CPU by default and mlx-lm in the checkpoint's dtype: --dtype sets moebench's, so the
two arms compare like for like.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

GB = 1e9


def peak_of(run) -> tuple[float, float]:
    """(peak beyond the memory held before, seconds) of run()."""
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    run()
    mx.synchronize()
    return (mx.get_peak_memory() - before) / GB, time.perf_counter() - t


def hook_layers(layer_class, log: list) -> None:
    """Evaluate each layer's output as it is built and log (layer index, peak since the last layer) ."""
    original = layer_class.__call__
    counter = {"i": 0}

    def call(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        mx.eval(out)
        mx.synchronize()
        log.append((counter["i"], type(self).__name__, mx.get_peak_memory() / GB))
        counter["i"] += 1
        mx.reset_peak_memory()
        return out

    layer_class.__call__ = call


def moebench_arm(path: str, ids: list[int], dtype: str | None):
    import moebench
    from moebench.decode.compiled import CompiledForward
    from moebench.execution.executor import executor

    model, _ = moebench.load(path, dtype=getattr(mx, dtype) if dtype else None)
    ex = executor(model)

    def run():
        cf = CompiledForward(ex, len(ids) + 128, 3)
        logits, _ = cf(mx.array(ids, dtype=mx.uint32), ex.settings)
        mx.eval(logits)

    return model, run, type(model.layers[0])


def mlx_lm_arm(path: str, ids: list[int], dtype: str | None):
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(path)

    def run():
        token, _ = next(generate_step(mx.array(ids, dtype=mx.uint32), model, max_tokens=1))
        mx.eval(token)

    return model, run, type(model.layers[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("prompt", type=int)
    p.add_argument("--arms", default="moebench,mlx-lm")
    p.add_argument("--hooked", action="store_true")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dtype", default=None, help="moebench's activation dtype (default: moebench.load's)")
    a = p.parse_args()
    ids = [(i * 7919) % a.vocab + 1 for i in range(a.prompt)]
    report = {"prompt": a.prompt, "mlx": mx.__version__, "device": str(mx.default_device()), "arms": {}}
    for arm in a.arms.split(","):
        model, run, layer_class = (moebench_arm if arm == "moebench" else mlx_lm_arm)(a.ckpt, ids, a.dtype)
        weights = mx.get_active_memory() / GB
        run()  # warm-up (kernels compiled)
        whole, seconds = peak_of(run)
        entry = {"weights_gb": weights, "peak_beyond_gb": whole, "seconds": seconds}
        if a.hooked:
            log: list = []
            hook_layers(layer_class, log)
            peak_of(run)
            layers = len(model.layers)
            entry["layers"] = [{"call": i // layers, "layer": i % layers, "type": name, "peak_beyond_gb": pk - weights}
                               for i, name, pk in log]
        report["arms"][arm] = entry
        print(arm, json.dumps({k: v for k, v in entry.items() if k != "layers"}), flush=True)
        if a.hooked:
            top = sorted(entry["layers"], key=lambda r: -r["peak_beyond_gb"])[:8]
            for r in top:
                print("   ", r, flush=True)
        del model, run
        mx.clear_cache()
    with open(f"prefill-memory-{a.prompt}.json", "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
