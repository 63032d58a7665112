#!/usr/bin/env bash
# Installs everything keras_boost needs on a fresh Debian 12 machine: system packages,
# the .venv, TensorFlow/Keras, and Horovod built with TensorFlow + MPI + Gloo.
# Idempotent: a rerun checks each step and skips what is already in place.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
TF_VERSION="2.18.1"
HVD_VERSION="0.28.1"
CACHE="${KERAS_BOOST_CACHE:-$HOME/.cache/keras_boost}"
DATA_DIR="/usr/share/datasets/fashion-mnist"
APT_PACKAGES=(openmpi-bin libopenmpi-dev cmake g++ libhighwayhash-dev libfarmhash-dev dataset-fashion-mnist)
PY_PACKAGES=("tensorflow-cpu==$TF_VERSION" "keras>=3.15,<3.16" "mpi4py==4.1.2" "pytest" "pytest-timeout" "hypothesis" "matplotlib" "cloudpickle" "psutil" "pyyaml")

step() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

step "1/5 system packages: ${APT_PACKAGES[*]}"
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  step "    installing ${missing[*]}"
  $SUDO apt-get update -qq || die "apt-get update failed (no access to the Debian mirror?)"
  log=$(mktemp)
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >"$log" 2>&1 \
    || { tail -30 "$log"; die "apt-get install ${missing[*]} failed"; }
  rm -f "$log"
else
  step "    all present"
fi
[ -f "$DATA_DIR/train-images-idx3-ubyte.gz" ] || die "Fashion-MNIST not found in $DATA_DIR after installing dataset-fashion-mnist"

step "2/5 virtual environment in $VENV"
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV" || die "python3 -m venv failed"
  "$PY" -m pip install -q --upgrade "pip<26" wheel setuptools || die "could not upgrade pip in the venv"
else
  step "    exists"
fi

step "3/5 TensorFlow $TF_VERSION, Keras 3, mpi4py, test tools"
if ! "$PY" -c "import tensorflow as tf, sys; sys.exit(tf.__version__ != '$TF_VERSION')" 2>/dev/null \
   || ! "$PY" -c "import pytest, pytest_timeout, hypothesis, matplotlib, mpi4py, psutil" 2>/dev/null; then
  "$PY" -m pip install -q "${PY_PACKAGES[@]}" || die "pip install of ${PY_PACKAGES[*]} failed"
else
  step "    already installed"
fi

step "4/5 Horovod $HVD_VERSION (TensorFlow + MPI + Gloo)"
hvd_ok() {
  HVD_VERSION="$HVD_VERSION" "$PY" -c '
import os, sys, horovod, horovod.tensorflow as hvd
sys.exit(0 if horovod.__version__ == os.environ["HVD_VERSION"] and hvd.mpi_built() and hvd.gloo_built() else 1)
' 2>/dev/null
}
if hvd_ok; then
  step "    already installed"
else
  PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  WHEEL_DIR="$CACHE/horovod-$HVD_VERSION-tf$TF_VERSION-$PYTAG-$(uname -m)"
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    step "    no cached wheel in $WHEEL_DIR: building (about 2-3 minutes on 2 cores)"
    mkdir -p "$WHEEL_DIR"
    tmp=$(mktemp -d "$WHEEL_DIR.build.XXXX")
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel -q --no-build-isolation --no-cache-dir --no-deps -w "$tmp" "horovod==$HVD_VERSION" \
      || { rm -rf "$tmp"; die "building horovod==$HVD_VERSION failed (see the compiler output above)"; }
    mv "$tmp"/horovod-*.whl "$WHEEL_DIR"/ && rm -rf "$tmp"
  else
    step "    using cached wheel from $WHEEL_DIR"
  fi
  "$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl || die "installing the horovod wheel failed"
  "$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi >/dev/null || die "installing horovod's dependencies failed"
  hvd_ok || die "horovod imports but was not built with both MPI and Gloo"
fi

step "5/5 keras_boost (editable) and the keras-boost command"
if [ "$(cd /tmp && "$PY" -c 'import os, keras_boost; print(os.path.dirname(os.path.dirname(keras_boost.__file__)))' 2>/dev/null)" != "$ROOT" ] \
   || [ ! -x "$VENV/bin/keras-boost" ] || ! "$VENV/bin/keras-boost" --help >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null || die "pip install -e $ROOT failed"
fi
"$VENV/bin/keras-boost" --help >/dev/null || die "the keras-boost command does not run"
step "done: $("$PY" -c 'import tensorflow as tf, keras, horovod; print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, Horovod {horovod.__version__}")')"
