#!/usr/bin/env bash
# The prepared device check for a GPU machine, in at most 8 minutes (GPU_CHECK_BUDGET_S, default 470 s):
#   1. the GPUs nvidia-smi lists;            2. ./scripts/setup.sh (the wheel cache makes it quick);
#   3. keras-boost info (GPUs, pinning, NCCL); 4. the GPU tests (tests/test_gpu.py, tests/test_setup_plan.py);
#   5. a short benchmark: keras.Model vs BoostModel O0/O1/O2 on ResNet50 224x224 synthetic data, float32 and
#      mixed precision, 1 process, then 2 processes under horovodrun when the machine has 2 GPUs.
# Everything goes to the output folder: $1, else $OUT, else ./gpu_check_out (summary.md holds the table).
#
# Without a GPU the same script runs its CPU parts: the tests (GPU tests skip with their reason) and a
# smoke benchmark on the small demo model. Knobs: GPU_CHECK_SKIP_SETUP=1 (use the current environment),
# KB_PYTHON (the Python to use; default .venv/bin/python), GPU_CHECK_TESTS (the pytest arguments),
# GPU_CHECK_BENCH_ARGS (extra bench_gpu.py arguments).
set -uo pipefail
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/gpu_check_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
BUDGET="${GPU_CHECK_BUDGET_S:-470}"
DEADLINE=$((SECONDS + BUDGET))
SUMMARY="$OUT_DIR/summary.md"
status=0

say() { echo "[gpu_check] $*" | tee -a "$OUT_DIR/gpu_check.log"; }
left() { local s=$((DEADLINE - SECONDS)); [ "$s" -gt 1 ] && echo "$s" || echo 1; }
# run_step NAME LOGFILE COMMAND...: runs COMMAND within the time left, logs it, records the outcome.
run_step() {
  local name="$1" log="$2"; shift 2
  say "$name: $* (at most $(left) s)"
  timeout --kill-after=10 "$(left)" "$@" >"$log" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then say "$name: ok"; else say "$name: FAILED (exit $rc, see $(basename "$log"))"; status=1; fi
  echo "- $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)")" >>"$SUMMARY"
  return $rc
}

: >"$OUT_DIR/gpu_check.log"
echo "# keras_boost GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ))" >"$SUMMARY"
echo >>"$SUMMARY"

# 1. GPUs
NUM_GPUS=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >"$OUT_DIR/nvidia-smi.txt" 2>&1; then
  NUM_GPUS=$(grep -c '^GPU [0-9]' "$OUT_DIR/nvidia-smi.txt" || true)
  nvidia-smi >>"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
else
  echo "no nvidia-smi or no driver" >"$OUT_DIR/nvidia-smi.txt"
fi
say "GPUs: $NUM_GPUS"
echo "- GPUs (nvidia-smi): $NUM_GPUS" >>"$SUMMARY"

# 2. setup
if [ "${GPU_CHECK_SKIP_SETUP:-0}" = 1 ]; then
  say "setup: skipped (GPU_CHECK_SKIP_SETUP=1)"
  echo "- setup: skipped" >>"$SUMMARY"
else
  "$ROOT/scripts/setup.sh" --print-plan >"$OUT_DIR/setup-plan.txt" 2>&1 || true
  run_step setup "$OUT_DIR/setup.log" "$ROOT/scripts/setup.sh" || { say "no usable environment: stopping"; exit 1; }
  grep "Horovod GPU operations" "$OUT_DIR/setup.log" | sed 's/^\[setup\] *//; s/^/- /' >>"$SUMMARY"
fi
PY="${KB_PYTHON:-$ROOT/.venv/bin/python}"
HOROVODRUN="$(dirname "$PY")/horovodrun"
cd "$ROOT"

# 3. info
run_step "keras-boost info" "$OUT_DIR/info.txt" "$PY" -m keras_boost.app.cli info
{ echo; echo '```'; cat "$OUT_DIR/info.txt"; echo '```'; echo; } >>"$SUMMARY"

# 4. tests
read -r -a TEST_ARGS <<<"${GPU_CHECK_TESTS:-tests/test_gpu.py tests/test_setup_plan.py}"
run_step "GPU tests" "$OUT_DIR/tests.txt" "$PY" -m pytest -p no:cacheprovider -q -rs --timeout=400 "${TEST_ARGS[@]}"
tail -n 15 "$OUT_DIR/tests.txt" | grep -E "passed|failed|SKIPPED|error" | sed 's/^/    /' >>"$SUMMARY"

# 5. benchmark (rows are appended to bench.md by rank 0)
read -r -a EXTRA <<<"${GPU_CHECK_BENCH_ARGS:-}"
BENCH=("$PY" scripts/bench_gpu.py --out "$OUT_DIR/bench.md")
if [ "$NUM_GPUS" -eq 0 ]; then
  BENCH+=(--model demo --batch-size 8 --steps 2 --warmup 1 --runners keras O1)  # CPU: a smoke run of the code path
  say "no GPU: benchmark smoke run on the demo model"
fi
rm -f "$OUT_DIR/bench.md"
run_step "benchmark, 1 process" "$OUT_DIR/bench-1.log" "${BENCH[@]}" --deadline "$(( $(date +%s) + $(left) - 120 ))" "${EXTRA[@]}"
if [ "$NUM_GPUS" -ge 2 ]; then
  run_step "benchmark, 2 processes" "$OUT_DIR/bench-2.log" "$HOROVODRUN" -np 2 -H localhost:2 --gloo \
    "${BENCH[@]}" --runners O0 O1 O2 --deadline "$(( $(date +%s) + $(left) - 60 ))" "${EXTRA[@]}"
fi
{ echo; echo "## Benchmark"; echo; cat "$OUT_DIR/bench.md" 2>/dev/null || echo "(no table)"; } >>"$SUMMARY"
say "done in $SECONDS s: $( [ $status -eq 0 ] && echo all ok || echo SOME STEPS FAILED ); summary: $SUMMARY"
exit $status
