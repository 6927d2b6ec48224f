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
# Only moebench's top-level API (load, generate, fused_moe), which every revision has, whatever its layout.
import json, statistics, sys
import moebench
model, _ = moebench.load(sys.argv[1])
ids = [(i * 7919 + 11) % model.args.vocab_size for i in range(64)]
out = {"moebench": moebench.__file__.rsplit("/", 2)[0].rsplit("/", 1)[-1]}
for on in (False, True):
    with moebench.fused_moe(on):
        moebench.generate(model, ids, 16)
        out["fused" if on else "fallback"] = statistics.median(moebench.generate(model, ids, 128).decode_tps for _ in range(3))
print(json.dumps(out))
PY
cd "$work"  # python puts the script's folder first on sys.path: PYTHONPATH alone picks each revision
for round in $(seq "$rounds"); do
  for rev in "$old" "$new"; do
    echo "round $round $rev $(PYTHONPATH="$work/$rev" python3 "$work/measure.py" "$model")"
  done
done
