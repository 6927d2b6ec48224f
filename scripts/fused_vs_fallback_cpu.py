"""Decode speed of the fused path against the fallback, recording on and off: notebook 04's four arms
(moebench.widgets.bench.measure: fresh Steppers, arms interleaved and rotated round by round, the first round
dropped as warm-up), with the fused-on / fused-off ratio of each round. One JSON line per run.

    python3 scripts/fused_vs_fallback_cpu.py [MODEL] [--rounds N] [--tokens T] [--prompt-tokens P]

MODEL defaults to the shipped model (data/tiny-qwen2-moe, run from the checkout's root). Uses only
moebench.load, Stepper and widgets.bench.measure, so it runs against an older checkout too (PYTHONPATH=that
checkout) for before/after comparisons.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

import moebench
from moebench.inspect.record import Stepper
from moebench.widgets.bench import measure

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model", nargs="?", default="data/tiny-qwen2-moe", help="checkpoint folder (default: shipped)")
parser.add_argument("--rounds", type=int, default=7, help="measured rounds (after one warm-up round)")
parser.add_argument("--tokens", type=int, default=128, help="tokens decoded by each arm in each round")
parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens")
parser.add_argument("--cpu", action="store_true", help="run on the CPU on a machine with a GPU")
a = parser.parse_args()
if a.cpu:
    mx.set_default_device(mx.cpu)
model, tokenizer = moebench.load(a.model)
ids = [(i * 7919 + 11) % model.args.vocab_size for i in range(a.prompt_tokens)]
runs = measure(lambda **o: Stepper(model, tokenizer, ids, **o), tokens=a.tokens, rounds=a.rounds)
kept = runs[~runs["warmup"]]
out = {"moebench": moebench.__file__, "mlx": mx.__version__,
       "device": str(mx.default_device()),
       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": a.rounds, "tokens": a.tokens}
for recording in (False, True):
    rows = kept[kept["recording"] == recording]
    on = rows[rows["fused"]].set_index("round")["tok_s"]
    off = rows[~rows["fused"]].set_index("round")["tok_s"]
    ratios = (on / off).tolist()
    out["recording" if recording else "clean"] = {
        "fused_tok_s": statistics.median(on), "fallback_tok_s": statistics.median(off),
        "on_over_off": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
print(json.dumps(out))
