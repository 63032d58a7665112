"""The compute precision of a run: mixed precision where the hardware has native low-precision math.

`keras-boost train/bench --precision auto` (the default), `resolve_precision("auto", level)`
and `keras_boost.precision.set_auto_policy(level)` (for your own script, before the model
is built) choose, for the boost levels O1 and O2:
- on GPUs: `mixed_bfloat16` when every visible GPU has compute capability 8.0 or more
  (Ampere, Hopper: bfloat16 tensor cores; no loss scaling needed); `mixed_float16` on
  compute capability 7.x (Volta, Turing: float16 tensor cores only), with keras_boost's
  dynamic loss scale (`BoostModel.compile(loss_scale=None)` turns it on under this
  policy); float32 on older GPUs;
- on CPUs: `mixed_bfloat16` when the CPU has native bfloat16 instructions (the
  `avx512_bf16` or `amx_bf16` flag in /proc/cpuinfo: Cooper Lake, Sapphire Rapids and
  later Xeons, Zen 4 and later) and TensorFlow's oneDNN kernels are on (TensorFlow's
  default on such CPUs; `TF_ENABLE_ONEDNN_OPTS=0` turns them off), where oneDNN runs
  bfloat16 convolutions and matrix products in hardware (measured in docs/benchmarks.md,
  "Mixed precision on CPUs", per step and in time to O0's accuracy: faster on the demo,
  mnist_convnet and the text transformer; on a step with little arithmetic, such as
  keras-io's timeseries FCN, it does not pay); float32 on every other CPU, and with oneDNN off, where
  bfloat16 is emulated and many times slower (docs/benchmarks.md);
- float32 at level O0, which stays plain Keras, and wherever the hardware is unknown.
"""

import os

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
CHOICES = ("auto", *POLICIES)
AUTO_LEVELS = ("O1", "O2")


def choose_policy(precision, level, compute_capabilities, cpu_bf16=False):
    """The Keras dtype policy name for `precision` at boost `level` on this hardware.

    Pure (no TensorFlow): the rule of `resolve_precision`.

    Args:
        precision: "auto" or one of POLICIES (returned unchanged).
        level: the boost level, "O0", "O1" or "O2" (None counts as "O0").
        compute_capabilities: one `(major, minor)` per visible GPU; empty on a CPU machine.
        cpu_bf16: whether the CPU has native bfloat16 instructions (`cpu_has_native_bf16`)
            and TensorFlow's oneDNN kernels use them (`onednn_enabled`); used when there is
            no GPU.
    """
    if precision not in CHOICES:
        raise ValueError(f"precision must be one of {CHOICES}, got {precision!r}")
    if precision != "auto":
        return precision
    if (level or "O0") not in AUTO_LEVELS:
        return "float32"
    capabilities = [tuple(c) if c else None for c in compute_capabilities]
    if not capabilities:
        return "mixed_bfloat16" if cpu_bf16 else "float32"
    if None in capabilities:
        return "float32"
    lowest = min(capabilities)
    if lowest >= (8, 0):
        return "mixed_bfloat16"
    if lowest >= (7, 0):
        return "mixed_float16"
    return "float32"


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo="/proc/cpuinfo"):
    """The CPU's feature flags (the `flags` line of /proc/cpuinfo); empty where it cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16(flags=None):
    """Whether the CPU computes in bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags() if flags is None else set(flags)
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def onednn_enabled():
    """Whether this TensorFlow runs its oneDNN CPU kernels (`TF_ENABLE_ONEDNN_OPTS`, else TF's own default).

    TensorFlow decides once per process from the variable and the CPU; without oneDNN its
    bfloat16 convolutions and matrix products are Eigen's emulation even on a CPU with
    AVX512-BF16. Asked of TensorFlow itself (`IsMklEnabled`, which reads the same
    variable); where that is not available, read from the variable like TensorFlow does.
    """
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        value = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").strip().lower()
        return value not in ("0", "false", "no", "off")


def gpu_compute_capabilities():
    """`(major, minor)` of every GPU TensorFlow uses in this process (after pinning: one)."""
    import tensorflow as tf

    found = []
    for device in tf.config.get_visible_devices("GPU"):
        capability = tf.config.experimental.get_device_details(device).get("compute_capability")
        found.append(tuple(capability) if capability else None)
    return found


def resolve_precision(precision, level):
    """`choose_policy` on this process's GPUs and CPU; call after `distributed.init()` (GPU pinning)."""
    if precision != "auto":
        return choose_policy(precision, level, [])
    capabilities = gpu_compute_capabilities()
    cpu_bf16 = not capabilities and cpu_has_native_bf16() and onednn_enabled()
    return choose_policy(precision, level, capabilities, cpu_bf16=cpu_bf16)


def set_auto_policy(level="O1", precision="auto"):
    """Sets Keras' global dtype policy to `resolve_precision(precision, level)`; returns its name.

    Call it before the model's layers are made (the policy is read when a layer is
    created), as `keras.config.set_dtype_policy`:

    >>> keras_boost.precision.set_auto_policy("O1")   # 'mixed_bfloat16' on an AVX512-BF16 CPU
    >>> model = keras_boost.BoostModel(inputs, outputs, boost_level="O1")
    """
    import keras

    policy = resolve_precision(precision, level)
    keras.config.set_dtype_policy(policy)
    return policy
