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
echo "moebench installed: $(python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())')"
