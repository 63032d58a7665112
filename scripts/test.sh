#!/usr/bin/env bash
# Runs the whole keras_boost test suite (single- and multi-process), setting up first when needed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
source "$ROOT/scripts/venv.sh"  # TF_VERSION=2.18.1 ./scripts/test.sh runs the suite on that TensorFlow
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q --timeout=600 "$@" tests
