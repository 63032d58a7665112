#!/usr/bin/env bash
# A host that loses its link mid-run under Open MPI, launched by `keras-boost train` from the
# first of two namespace hosts (docs/reliability.md, "A host that drops off under MPI").
# Needs root. Usage: ./scripts/experiments/mpi_host_drop.sh [LOG]
#   ./scripts/cluster.sh up 2 first; ./scripts/cluster.sh down after.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LOG="${1:-/tmp/mpi_host_drop.log}"
cd "$ROOT"
start=$(date +%s)
./scripts/cluster.sh run kbh1 -- env KERAS_BOOST_STALL_TIMEOUT=20 TF_CPP_MIN_LOG_LEVEL=2 timeout 600 \
    "$ROOT/.venv/bin/keras-boost" train --hosts kbh1:1,kbh2:1 --controller mpi --epochs 30 \
    --train-samples 6000 --batch-size 32 > "$LOG" 2>&1 &
launcher=$!
for _ in $(seq 1 300); do grep -q "Epoch 2/" "$LOG" && break; sleep 1; done
sleep 3
ip netns exec kbhsw ip link set kbh2v down
down=$(date +%s)
echo "kbh2's link down $((down - start)) s after the launch"
wait $launcher; rc=$?
echo "exit status $rc, $(( $(date +%s) - down )) s after the link went down (log: $LOG)"
ip netns exec kbhsw ip link set kbh2v up
