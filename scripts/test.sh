#!/usr/bin/env bash
# Runs the whole keras_boost test suite (single- and multi-process), setting up first when needed.
#
# Two phases (tests/conftest.py marks the tests that launch processes `launches`):
#   1. the tests that stay in pytest's process, KB_TEST_WORKERS at a time (default 2, pytest-xdist);
#   2. the tests that launch workers, hosts or a scheduler, one at a time, on an otherwise idle machine.
# Options are passed to both phases (./scripts/test.sh --durations=40). Given test paths or -k/-m,
# it runs one plain pytest over them instead (./scripts/test.sh tests/test_ema.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
source "$ROOT/scripts/venv.sh"  # TF_VERSION=2.18.1 ./scripts/test.sh runs the suite on that TensorFlow
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
PYTEST=("$VENV/bin/python" -m pytest -p no:cacheprovider -q --timeout=600)

for arg in "$@"; do
  case "$arg" in
    -k|-m|-k*|-m*|tests*|*.py|*::*) exec "${PYTEST[@]}" "$@" ;;
  esac
done

start=$SECONDS
status=0
"${PYTEST[@]}" -n "${KB_TEST_WORKERS:-2}" -m "not launches" "$@" tests || status=$?
echo "[test] phase 1 (in-process tests, ${KB_TEST_WORKERS:-2} at a time): $((SECONDS - start)) s, exit $status"
start2=$SECONDS
"${PYTEST[@]}" -m launches "$@" tests || status=$((status == 0 ? $? : status))
echo "[test] phase 2 (tests that launch processes, one at a time): $((SECONDS - start2)) s;" \
     "the suite: $((SECONDS - start)) s, exit $status"
exit "$status"
