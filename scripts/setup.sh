#!/usr/bin/env bash
# Installs everything keras_boost needs on a fresh Debian 12 machine: system packages,
# the venv, TensorFlow/Keras, and Horovod built with TensorFlow + MPI + Gloo.
# Idempotent: a rerun checks each step and skips what is already in place.
#
# TF_VERSION=2.18.1 ./scripts/setup.sh sets up another supported TensorFlow (see
# keras_boost/_versions.py; the default is the newest) in its own venv, .venv-tf2.18.1 (the
# default's is .venv); test.sh and demo.sh take the same variable. Horovod is built from its
# sdist with keras_boost/horovod_patches applied (keras_boost/app/horovod_build.py, the code
# behind `keras-boost build-horovod`), one cached wheel per TensorFlow version.
#
# On a machine with an NVIDIA GPU (`nvidia-smi -L` lists one) it installs
# tensorflow[and-cuda] instead of tensorflow-cpu and builds Horovod with NCCL GPU
# operations (NCCL and nvcc from their PyPI packages); if that build fails it builds
# Horovod with CPU operations (GPU tensors are staged through host memory) and says so.
#
#   ./scripts/setup.sh               set up (or check) everything
#   ./scripts/setup.sh --print-plan  print the variant, TensorFlow package and wheel cache; change nothing
#
# KERAS_BOOST_DEVICE=cpu|gpu overrides the detection; KERAS_BOOST_CACHE moves the wheel cache.
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
step() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }
command -v python3 >/dev/null || die "python3 not found: install Python 3.10 or 3.11 (Debian: apt-get install python3 python3-venv)"
source "$ROOT/scripts/venv.sh"
python3 "$ROOT/keras_boost/_versions.py" check "$TF_VERSION" || exit 1
HVD_VERSION="$(cd "$ROOT/keras_boost" && python3 -c 'import _versions; print(_versions.HOROVOD)')"
CACHE="${KERAS_BOOST_CACHE:-$HOME/.cache/keras_boost}"
# The patch set's id, as keras_boost/app/horovod_build.py computes it: a changed patch builds anew.
PATCH_ID="$(cat $(ls "$ROOT"/keras_boost/horovod_patches/*.patch | LC_ALL=C sort) | sha256sum | cut -c1-8)"
DATA_DIR="/usr/share/datasets/fashion-mnist"
# openssh-server, iproute2 and util-linux: the multi-host tests' cluster of network-namespace hosts (tests/cluster.py)
# patch: keras_boost/horovod_patches; slurm-wlm and munge: the Slurm tests' scheduler (tests/slurm.py)
APT_PACKAGES=(openmpi-bin libopenmpi-dev cmake g++ patch libhighwayhash-dev libfarmhash-dev dataset-fashion-mnist
              openssh-server openssh-client iproute2 util-linux slurm-wlm munge)
# TensorFlow 2.19's headers include LLVM headers its wheel does not ship (TensorFlow issue #90026)
case "$TF_VERSION" in 2.19.*) APT_PACKAGES+=(llvm-14-dev) ;; esac
# tensorboard: tf.summary (Keras' TensorBoard callback); tensorflow-cpu 2.21 no longer pulls it in
TOOL_PACKAGES=("keras>=3.15,<3.16" "tensorboard" "mpi4py==4.1.2" "pytest" "pytest-timeout" "pytest-xdist" "hypothesis"
               "matplotlib" "cloudpickle" "psutil" "pyyaml")
GPU_BUILD_PACKAGES=("nvidia-nccl-cu12" "nvidia-cuda-nvcc-cu12")

# ---------------------------------------------------------------- the plan
# detect_gpus: prints the number of NVIDIA GPUs `nvidia-smi -L` lists (0 without nvidia-smi or a driver).
detect_gpus() {
  command -v nvidia-smi >/dev/null 2>&1 || { echo 0; return; }
  local listing
  listing=$(nvidia-smi -L 2>/dev/null) || { echo 0; return; }
  printf '%s\n' "$listing" | grep -c '^GPU [0-9]' || true
}

# plan PYTAG: sets VARIANT (cpu|gpu), NUM_GPUS, DETECTED_BY, TF_PACKAGE, WHEEL_BASE and the wheel
# cache folders (WHEEL_DIR for cpu; NCCL_WHEEL_DIR, CPUOPS_WHEEL_DIR and NCCL_FAILED for gpu).
# The cpu cache folder is the one setup.sh has always used, so existing caches stay valid.
plan() {
  local pytag="$1"
  NUM_GPUS=$(detect_gpus)
  case "${KERAS_BOOST_DEVICE:-auto}" in
    auto) if [ "$NUM_GPUS" -gt 0 ]; then VARIANT=gpu; DETECTED_BY="nvidia-smi lists $NUM_GPUS GPU(s)"
          else VARIANT=cpu; DETECTED_BY="no NVIDIA GPU found by nvidia-smi"; fi ;;
    cpu) VARIANT=cpu; DETECTED_BY="KERAS_BOOST_DEVICE=cpu" ;;
    gpu) VARIANT=gpu; DETECTED_BY="KERAS_BOOST_DEVICE=gpu" ;;
    *) die "KERAS_BOOST_DEVICE must be auto, cpu or gpu, got '${KERAS_BOOST_DEVICE}'" ;;
  esac
  WHEEL_BASE="$CACHE/horovod-$HVD_VERSION-tf$TF_VERSION-$pytag-$(uname -m)-p$PATCH_ID"
  if [ "$VARIANT" = cpu ]; then
    TF_PACKAGE="tensorflow-cpu==$TF_VERSION"
    WHEEL_DIR="$WHEEL_BASE"
  else
    TF_PACKAGE="tensorflow[and-cuda]==$TF_VERSION"
    NCCL_WHEEL_DIR="$WHEEL_BASE-cuda12-nccl"
    CPUOPS_WHEEL_DIR="$WHEEL_BASE-cuda12-cpuops"
    NCCL_FAILED="$NCCL_WHEEL_DIR.failed"
    WHEEL_DIR="$NCCL_WHEEL_DIR"
    [ -f "$NCCL_FAILED" ] && ! ls "$NCCL_WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1 && WHEEL_DIR="$CPUOPS_WHEEL_DIR"
  fi
  return 0
}

print_plan() {
  echo "venv: $VENV"
  echo "variant: $VARIANT ($DETECTED_BY)"
  echo "tensorflow: $TF_PACKAGE"
  if [ "$VARIANT" = cpu ]; then
    echo "horovod: CPU operations (TensorFlow + MPI + Gloo)"
  elif [ "$WHEEL_DIR" = "$NCCL_WHEEL_DIR" ]; then
    echo "horovod: NCCL GPU operations (HOROVOD_GPU_OPERATIONS=NCCL + MPI + Gloo), CPU operations if that build fails"
  else
    echo "horovod: CPU operations (GPU tensors staged through host memory): the NCCL build failed before ($NCCL_FAILED)"
  fi
  echo "wheel cache: $WHEEL_DIR"
}

if [ "${1:-}" = "--print-plan" ]; then
  PYBIN="$VENV/bin/python"; [ -x "$PYBIN" ] || PYBIN=python3
  plan "$("$PYBIN" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
  print_plan
  exit 0
elif [ $# -gt 0 ]; then
  die "unknown argument '$1' (the only option is --print-plan)"
fi

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
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
plan "$PYTAG"
[ "$VARIANT" = gpu ] && step "    GPU machine: $DETECTED_BY"

if [ "$VARIANT" = cpu ]; then
  PY_PACKAGES=("$TF_PACKAGE" "${TOOL_PACKAGES[@]}")
  step "3/5 TensorFlow $TF_VERSION, Keras 3, mpi4py, test tools"
  TF_CHECK="import tensorflow as tf, sys; sys.exit(tf.__version__ != '$TF_VERSION')"
else
  PY_PACKAGES=("$TF_PACKAGE" "${GPU_BUILD_PACKAGES[@]}" "${TOOL_PACKAGES[@]}")
  step "3/5 TensorFlow $TF_VERSION with CUDA, NCCL, nvcc, Keras 3, mpi4py, test tools"
  TF_CHECK="import tensorflow as tf, sys; sys.exit(tf.__version__ != '$TF_VERSION' or not tf.test.is_built_with_cuda())"
fi
if ! "$PY" -c "$TF_CHECK" 2>/dev/null \
   || ! "$PY" -c "import pytest, pytest_timeout, xdist, hypothesis, matplotlib, mpi4py, psutil, tensorboard" 2>/dev/null \
   || { [ "$VARIANT" = gpu ] && ! "$PY" -c "import nvidia.nccl, nvidia.cuda_nvcc" 2>/dev/null; }; then
  if [ "$VARIANT" = gpu ] && "$PY" -m pip show -q tensorflow-cpu >/dev/null 2>&1; then
    "$PY" -m pip uninstall -q -y tensorflow-cpu || die "could not remove tensorflow-cpu before installing $TF_PACKAGE"
  fi
  "$PY" -m pip install -q "${PY_PACKAGES[@]}" || die "pip install of ${PY_PACKAGES[*]} failed"
else
  step "    already installed"
fi

# hvd_ok NEED_NCCL: Horovod $HVD_VERSION imports, with MPI and Gloo (and NCCL when NEED_NCCL is 1).
hvd_ok() {
  HVD_VERSION="$HVD_VERSION" NEED_NCCL="${1:-0}" "$PY" -c '
import os, sys, horovod, horovod.tensorflow as hvd
ok = horovod.__version__ == os.environ["HVD_VERSION"] and hvd.mpi_built() and hvd.gloo_built()
sys.exit(0 if ok and (os.environ["NEED_NCCL"] != "1" or hvd.nccl_built()) else 1)
' 2>/dev/null
}

# build_wheel DIR [VAR=VALUE...]: builds the patched Horovod wheel into DIR with the extra build
# variables (keras-boost build-horovod's code: sdist, patches, progress); 1 on failure.
build_wheel() {
  local dir="$1"; shift
  env "$@" PYTHONPATH="$ROOT" KERAS_BOOST_CACHE="$CACHE" "$PY" -m keras_boost.app.horovod_build --wheel-dir "$dir"
}

# cuda_trees: one CUDA tree (bin/nvcc, nvvm, include, lib64) and one NCCL tree (include, lib/libnccl.so)
# made of links into the PyPI packages nvidia-cuda-nvcc-cu12, nvidia-cuda-runtime-cu12 and
# nvidia-nccl-cu12, laid out the way Horovod's CMake looks for them; sets CUDA_TREE and NCCL_TREE.
cuda_trees() {
  local nv
  nv=$("$PY" -c 'import os, nvidia.cuda_nvcc as m; print(os.path.dirname(list(m.__path__)[0]))') || return 1
  CUDA_TREE="$CACHE/cuda12-tree-$PYTAG"
  NCCL_TREE="$CACHE/nccl-tree-$PYTAG"
  rm -rf "$CUDA_TREE" "$NCCL_TREE"
  mkdir -p "$CUDA_TREE/include" "$CUDA_TREE/lib64" "$NCCL_TREE/lib"
  cp -r "$nv/cuda_nvcc/bin" "$CUDA_TREE/bin"  # real files: nvcc finds nvvm and includes next to itself
  ln -s "$nv/cuda_nvcc/nvvm" "$CUDA_TREE/nvvm"
  local pkg
  for pkg in "$nv"/*/; do
    [ -d "$pkg/include" ] && cp -rs --remove-destination "$pkg/include/." "$CUDA_TREE/include/"
    [ -d "$pkg/lib" ] && cp -rs --remove-destination "$pkg/lib/." "$CUDA_TREE/lib64/"
  done
  [ -e "$CUDA_TREE/lib64/libcudart.so" ] || ln -s libcudart.so.12 "$CUDA_TREE/lib64/libcudart.so"
  ln -s "$nv/nccl/include" "$NCCL_TREE/include"
  cp -rs "$nv/nccl/lib/." "$NCCL_TREE/lib/"
  [ -e "$NCCL_TREE/lib/libnccl.so" ] || ln -s libnccl.so.2 "$NCCL_TREE/lib/libnccl.so"
}

install_wheel() {
  "$PY" -m pip install -q --force-reinstall --no-deps "$1"/horovod-*.whl || die "installing the horovod wheel failed"
  "$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi >/dev/null || die "installing horovod's dependencies failed"
}

if [ "$VARIANT" = cpu ]; then
  step "4/5 Horovod $HVD_VERSION (TensorFlow + MPI + Gloo)"
  if hvd_ok 0; then
    step "    already installed"
  else
    if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
      step "    no cached wheel in $WHEEL_DIR: building (about 4 minutes on 2 cores)"
      build_wheel "$WHEEL_DIR" || die "building horovod==$HVD_VERSION failed (see the compiler output above)"
    else
      step "    using cached wheel from $WHEEL_DIR"
    fi
    install_wheel "$WHEEL_DIR"
    hvd_ok 0 || die "horovod imports but was not built with both MPI and Gloo"
  fi
else
  step "4/5 Horovod $HVD_VERSION (TensorFlow + MPI + Gloo, NCCL GPU operations when they build)"
  NEED_NCCL=1; [ "$WHEEL_DIR" = "$CPUOPS_WHEEL_DIR" ] && NEED_NCCL=0
  if hvd_ok "$NEED_NCCL"; then
    step "    already installed"
  else
    if [ "$WHEEL_DIR" = "$NCCL_WHEEL_DIR" ] && ! ls "$NCCL_WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
      step "    no cached wheel in $NCCL_WHEEL_DIR: building with HOROVOD_GPU_OPERATIONS=NCCL"
      if cuda_trees && build_wheel "$NCCL_WHEEL_DIR" HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
           HOROVOD_CUDA_HOME="$CUDA_TREE" HOROVOD_NCCL_HOME="$NCCL_TREE" PATH="$CUDA_TREE/bin:$PATH" \
           HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-70,80,90}"; then
        step "    built Horovod with NCCL GPU operations"
      else
        touch "$NCCL_FAILED"
        WHEEL_DIR="$CPUOPS_WHEEL_DIR"
        step "    the NCCL build failed (output above): falling back to CPU operations (GPU tensors staged through" \
             "host memory); delete $NCCL_FAILED to try NCCL again"
      fi
    fi
    if [ "$WHEEL_DIR" = "$CPUOPS_WHEEL_DIR" ] && ! ls "$CPUOPS_WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
      step "    no cached wheel in $CPUOPS_WHEEL_DIR: building with CPU operations"
      build_wheel "$CPUOPS_WHEEL_DIR" || die "building horovod==$HVD_VERSION failed (see the compiler output above)"
    fi
    step "    installing the wheel from $WHEEL_DIR"
    install_wheel "$WHEEL_DIR"
    if [ "$WHEEL_DIR" = "$NCCL_WHEEL_DIR" ]; then
      hvd_ok 1 || die "horovod imports but was not built with MPI, Gloo and NCCL"
    else
      hvd_ok 0 || die "horovod imports but was not built with both MPI and Gloo"
    fi
  fi
  if "$PY" -c 'import sys, horovod.tensorflow as hvd; sys.exit(not hvd.nccl_built())' 2>/dev/null; then
    step "    Horovod GPU operations: NCCL"
  else
    step "    Horovod GPU operations: none (CPU operations; GPU tensors are staged through host memory)"
  fi
fi

step "5/5 keras_boost (editable) and the keras-boost command"
if [ "$(cd /tmp && "$PY" -c 'import os, keras_boost; print(os.path.dirname(os.path.dirname(keras_boost.__file__)))' 2>/dev/null)" != "$ROOT" ] \
   || [ ! -x "$VENV/bin/keras-boost" ] || ! "$VENV/bin/keras-boost" --help >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null || die "pip install -e $ROOT failed"
fi
"$VENV/bin/keras-boost" --help >/dev/null || die "the keras-boost command does not run"
step "done in $VENV: $("$PY" -c 'import keras_boost, tensorflow as tf, keras, horovod; print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, Horovod {horovod.__version__}")')"
