#!/usr/bin/env bash
# The main job: trains the demo residual CNN on Fashion-MNIST on 2 Horovod workers
# (one per GPU on a GPU machine: a single worker when it has one GPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
source "$ROOT/scripts/venv.sh"  # TF_VERSION=2.18.1 ./scripts/demo.sh runs on that TensorFlow
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
NP=2
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU [0-9]' || true)
if [ "$GPUS" -gt 0 ] && [ "$GPUS" -lt "$NP" ]; then
  NP=$GPUS
  echo "[demo] $GPUS GPU on this machine: $NP worker (keras_boost runs one worker per GPU)"
fi
exec "$VENV/bin/keras-boost" train --np "$NP" --dataset fashion_mnist --epochs "${EPOCHS:-2}" --batch-size 64 --level O1 --loss-scale dynamic "$@"
