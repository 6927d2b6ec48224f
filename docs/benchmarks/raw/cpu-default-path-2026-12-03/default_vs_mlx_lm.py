"""Issue 39's CPU bar in one process: moebench's default decode path before (an earlier revision, `git archive REV
moebench kernels` unpacked in SNAPSHOT, decoding with its own defaults) and after (this tree's generate defaults)
against mlx-lm's stream_generate, greedy from one random prompt, one untimed warm-up per arm, then ROUNDS rounds with
the arms interleaved and their order rotating; each round is printed as a JSON line as it ends (a run cut short keeps
the rounds done), then the medians and spreads.

    python3 default_vs_mlx_lm.py MODEL SNAPSHOT [ROUNDS] [PROMPT] [GEN]
"""

import json
import statistics
import sys
from pathlib import Path

from moebench.checkpoint.loader import load
from moebench.decode.loop import use_compiled
from moebench.tools.bench import (
    Arm,
    compare_traces,
    generate_tokens,
    mlx_lm_arms,
    platform_info,
    prompt_token_ids,
    snapshot_arms,
    timed_run,
)

path, snapshot = Path(sys.argv[1]), Path(sys.argv[2])
rounds, prompt, gen = (int(a) for a in (sys.argv[3:] + ["10", "64", "128"][len(sys.argv) - 3:])[:3])
model, _ = load(path)
ids = prompt_token_ids(model.args.vocab_size, prompt)
after = Arm("after: default", "moebench", "moebench", "default", "float32",
            lambda i, n: generate_tokens(model, i, n), model)
(before,) = snapshot_arms(snapshot, path, "on")
before.name = "before: default"
users = mlx_lm_arms(path)[0][0]
arms = [before, after, users]
print(json.dumps({"platform": platform_info(), "model": str(path), "prompt_tokens": prompt, "gen_tokens": gen,
                  "rounds": rounds, "after_compiled": use_compiled(model, None)}), flush=True)
traces = {}
for a in arms:
    traces[a.name] = timed_run(a, ids, gen, keep_logits=True)
    print(json.dumps({"warm-up": a.name, "decode_tps": round(traces[a.name].decode_tps, 2),
                      "tokens_vs_before": compare_traces(traces[before.name], traces[a.name])}), flush=True)
tps = {a.name: [] for a in arms}
for r in range(rounds):
    for i in range(len(arms)):
        arm = arms[(i + r) % len(arms)]
        run = timed_run(arm, ids, gen)
        assert run.token_ids == traces[arm.name].token_ids, arm.name
        tps[arm.name].append(run.decode_tps)
    print(json.dumps({"round": r + 1, **{k: round(v[-1], 2) for k, v in tps.items()}}), flush=True)
for name, values in tps.items():
    ratio = [v / u for v, u in zip(values, tps[users.name], strict=True)]
    gain = [v / b for v, b in zip(values, tps[before.name], strict=True)]
    print(f"{name:24s} tok/s median {statistics.median(values):8.2f} [{min(values):.2f}-{max(values):.2f}]  "
          f"/ mlx-lm {statistics.median(ratio):.3f} [{min(ratio):.3f}-{max(ratio):.3f}]  "
          f"/ before {statistics.median(gain):.3f} [{min(gain):.3f}-{max(gain):.3f}]", flush=True)
