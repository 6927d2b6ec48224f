#!/usr/bin/env bash
# Installs moebench with everything its tests need, on a fresh machine.
# Linux: MLX's CPU build (plain `mlx` cannot import on Linux) and Debian's chromium for the browser test.
# macOS: MLX with Metal. NVIDIA: use `pip install -e '.[cuda,dev]'` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = "Darwin" ]; then extra=apple; else extra=cpu; fi
python3 -m pip install -q -e ".[$extra,dev]"
if [ "$(uname -s)" = "Linux" ] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "setup: could not install chromium; the browser test will be skipped" >&2
  fi
fi
echo "moebench installed: $(python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())')"
