"""Decode speed of the fused path against the fallback, recording on and off: notebook 04's four arms, each a
fresh Stepper decoding the same prompt greedily, timed as Trace.decode_tps; the arms interleaved and their order
rotated round by round, the first round dropped as warm-up; the fused-on / fused-off ratio of each round. One JSON
line per run.

    python3 scripts/fused_vs_fallback_cpu.py [MODEL] [--rounds N] [--tokens T] [--prompt-tokens P] [--cpu]

MODEL defaults to the shipped model (data/tiny-qwen2-moe, run from the checkout's root). Uses only moebench.load
and the Stepper (no widgets, pandas or plotly), so it runs against an older checkout too (PYTHONPATH=that
checkout; scripts/compare_revisions_fused.sh) and on a machine with only MLX and numpy.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx

import moebench
from moebench.inspect.record import Stepper

ARMS = [(fused, recording) for fused in (True, False) for recording in (False, True)]

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
tps: dict[tuple[bool, bool], list[float]] = {arm: [] for arm in ARMS}
for r in range(1 + a.rounds):
    for fused, recording in ARMS[r % 4:] + ARMS[: r % 4]:
        trace = Stepper(model, tokenizer, ids, record=recording, fused=fused, stop_ids=()).run(a.tokens)
        if r:
            tps[fused, recording].append(trace.decode_tps)
out = {"moebench": moebench.__file__, "mlx": mx.__version__, "device": str(mx.default_device()),
       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": a.rounds, "tokens": a.tokens}
for recording in (False, True):
    on, off = tps[True, recording], tps[False, recording]
    ratios = [x / y for x, y in zip(on, off, strict=True)]
    out["recording" if recording else "clean"] = {
        "fused_tok_s": statistics.median(on), "fallback_tok_s": statistics.median(off),
        "on_over_off": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
print(json.dumps(out))
