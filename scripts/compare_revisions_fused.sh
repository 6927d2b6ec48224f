#!/usr/bin/env bash
# Notebook 04's four arms (fused on/off x recording on/off, scripts/fused_vs_fallback_cpu.py) for two revisions
# of moebench, a fresh process per revision, alternated for ROUNDS rounds: the fused/fallback ratio of each
# revision measured side by side on the same machine in one run. One JSON line per process.
#
#   bash scripts/compare_revisions_fused.sh OLD NEW [ROUNDS] [-- extra arguments of the script, e.g. --cpu]
#
# OLD and NEW are git revisions, or folders holding a revision's moebench/ and kernels/ (`git archive REV moebench
# kernels | tar -x -C DIR`: a copy without .git, such as the device machine's, takes those).
set -euo pipefail
old=$1 new=$2 rounds=${3:-4}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
here=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for side in old new; do
  rev=${!side}
  mkdir -p "$work/$side"
  if [ -d "$rev/moebench" ]; then
    cp -r "$rev/moebench" "$rev/kernels" "$work/$side/"
  else
    git archive "$rev" moebench kernels | tar -x -C "$work/$side"
  fi
done
cp scripts/fused_vs_fallback_cpu.py "$work/measure.py"
cd "$work"  # python puts the script's folder first on sys.path: PYTHONPATH alone picks each revision
for round in $(seq "$rounds"); do
  for side in old new; do
    echo "round $round $side ${!side} $(PYTHONPATH="$work/$side" python3 "$work/measure.py" "$here/data/tiny-qwen2-moe" "$@")"
  done
done
