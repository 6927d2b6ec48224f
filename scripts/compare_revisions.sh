#!/usr/bin/env bash
# Decode tok/s of two git revisions of moebench on one checkpoint, interleaved round by round (fused path
# on and off), so the ratio new/old is measured side by side on the same machine in one run.
#
#   bash scripts/compare_revisions.sh OLD_REV NEW_REV [MODEL] [ROUNDS]
#
# MODEL defaults to the shipped data/tiny-qwen2-moe; each round runs each revision in a fresh process
# (median of 3 greedy generations of 128 tokens after a 64-token prompt, per arm) and prints one JSON line.
set -euo pipefail
old=$1 new=$2 model=$(realpath "${3:-data/tiny-qwen2-moe}") rounds=${4:-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for rev in "$old" "$new"; do
  mkdir -p "$work/$rev" && git archive "$rev" moebench kernels | tar -x -C "$work/$rev"
done
cat > "$work/measure.py" <<'PY'
import json, statistics, sys
from moebench.bench import prompt_token_ids
from moebench.decode import generate
from moebench.kernels import fused_moe
from moebench.loader import load
model, _ = load(sys.argv[1])
ids = prompt_token_ids(model.args.vocab_size, 64, 0)
out = {"moebench": __import__("moebench").__file__.rsplit("/", 2)[0].rsplit("/", 1)[-1]}
for on in (False, True):
    with fused_moe(on):
        generate(model, ids, 16)
        out["fused" if on else "fallback"] = statistics.median(generate(model, ids, 128).decode_tps for _ in range(3))
print(json.dumps(out))
PY
cd "$work"  # python puts the script's folder first on sys.path: PYTHONPATH alone picks each revision
for round in $(seq "$rounds"); do
  for rev in "$old" "$new"; do
    echo "round $round $rev $(PYTHONPATH="$work/$rev" python3 "$work/measure.py" "$model")"
  done
done
