#!/usr/bin/env bash
# Fails when a committed notebook carries outputs, execution counts or widget state (run before committing;
# the test suite runs it too). Fix with: nbstripout notebooks/*.ipynb
set -euo pipefail
cd "$(dirname "$0")/.."
nbstripout --verify notebooks/*.ipynb
