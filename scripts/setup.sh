#!/usr/bin/env bash
# Installs moebench with everything its tests need, on a fresh machine, into the virtual environment .venv of this
# checkout (made when missing; `. .venv/bin/activate` then puts `moebench` and its Python first on PATH).
#   bash scripts/setup.sh [apple|cpu|cuda]
# The extra that brings MLX: apple (MLX with Metal) on macOS, cpu (MLX's CPU build: plain `mlx` cannot import on
# Linux) elsewhere, unless named; cuda on NVIDIA GPUs. Linux also gets Debian's chromium for the browser test,
# OpenBLAS, and python3-venv where Python lacks it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then extra=$1; elif [ "$(uname -s)" = "Darwin" ]; then extra=apple; else extra=cpu; fi
case "$extra" in apple|cpu|cuda) ;; *) echo "setup: extra '$extra' is none of apple, cpu, cuda" >&2; exit 2 ;; esac
# OpenBLAS: MLX's Linux wheels link the reference BLAS; train-tiny runs its float matmuls on OpenBLAS when it is
# installed, about 4x faster (docs/benchmarks/train-throughput-cpu-2026-12-01.md).
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  /sbin/ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' || missing+=(libopenblas0-pthread)
  [ -d .venv ] || python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)  # Debian's Python splits it off
  if [ ${#missing[@]} -gt 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
      || echo "setup: could not install ${missing[*]}; without chromium the browser test is skipped, without" \
              "OpenBLAS train-tiny runs on the reference BLAS, without python3-venv no .venv can be made" >&2
  fi
fi
# A self-contained environment: everything goes into .venv, never into the system's Python, and nothing is borrowed
# from it (with --system-site-packages, JupyterLab's widget and plotly extensions installed in the system's prefix
# were not found by the lab in .venv, so no widget rendered).
[ -d .venv ] || python3 -m venv .venv
python=.venv/bin/python
"$python" -m pip install -q -e ".[$extra,dev]"
# The notebook output filter that .gitattributes names: outputs, counts, widget state and the kernel's
# language_info details (all but its name) are stripped when git reads a notebook, so running the notebooks
# leaves `git diff` empty. Only in moebench's own checkout; running it again changes nothing.
if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
  "$python" -m nbstripout --install --attributes .gitattributes
  details=(codemirror_mode file_extension mimetype nbconvert_exporter pygments_lexer version)
  git config filter.nbstripout.extrakeys "${details[*]/#/metadata.language_info.}"
fi
echo "moebench installed in .venv (activate it: . .venv/bin/activate):" \
     "$("$python" -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())')"
