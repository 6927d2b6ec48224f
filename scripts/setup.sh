#!/usr/bin/env bash
# Installs moebench with everything its tests need, on a fresh machine.
# Linux: MLX's CPU build (plain `mlx` cannot import on Linux), Debian's chromium for the browser test and OpenBLAS.
# macOS: MLX with Metal. NVIDIA: use `pip install -e '.[cuda,dev]'` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = "Darwin" ]; then extra=apple; else extra=cpu; fi
python3 -m pip install -q -e ".[$extra,dev]"
# OpenBLAS: MLX's Linux wheels link the reference BLAS; train-tiny runs its float matmuls on OpenBLAS when it is
# installed, about 4x faster (docs/benchmarks/train-throughput-cpu-2026-12-01.md).
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  /sbin/ldconfig -p 2>/dev/null | grep -q 'libopenblas\.so\.0' || missing+=(libopenblas0-pthread)
  if [ ${#missing[@]} -gt 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
      || echo "setup: could not install ${missing[*]}; without chromium the browser test is skipped, without" \
              "OpenBLAS train-tiny runs on the reference BLAS" >&2
  fi
fi
# The notebook output filter that .gitattributes names: outputs, counts, widget state and the kernel's
# language_info details (all but its name) are stripped when git reads a notebook, so running the notebooks
# leaves `git diff` empty. Only in moebench's own checkout; running it again changes nothing.
if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
  python3 -m nbstripout --install --attributes .gitattributes
  details=(codemirror_mode file_extension mimetype nbconvert_exporter pygments_lexer version)
  git config filter.nbstripout.extrakeys "${details[*]/#/metadata.language_info.}"
fi
echo "moebench installed: $(python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())')"
