#!/usr/bin/env bash
# The main job: trains the demo residual CNN on Fashion-MNIST on 2 Horovod workers.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
export TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
exec "$ROOT/.venv/bin/keras-boost" train --np 2 --dataset fashion_mnist --epochs "${EPOCHS:-2}" --batch-size 64 --level O1 --loss-scale dynamic "$@"
