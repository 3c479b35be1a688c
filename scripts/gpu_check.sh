#!/usr/bin/env bash
# Every GPU check in one command: scripts/gpu_check.sh OUT_DIR [options]
# (see scripts/gpu_check.py, or run it with --help). Works from any directory: OUT_DIR is taken
# relative to where it is started, and the checks import nanovllm from this checkout.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$repo/scripts/gpu_check.py" "$@"
