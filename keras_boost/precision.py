"""The compute precision of a run: float32 on CPUs, mixed precision on GPUs that gain from it.

`keras-boost train/bench --precision auto` (the default) and `resolve_precision("auto", level)`
choose, for the boost levels O1 and O2 on GPUs:
- `mixed_bfloat16` when every visible GPU has compute capability 8.0 or more (Ampere,
  Hopper: bfloat16 tensor cores; no loss scaling needed);
- `mixed_float16` on compute capability 7.x (Volta, Turing: float16 tensor cores only),
  with keras_boost's dynamic loss scale (`BoostModel.compile(loss_scale=None)` turns it on
  under this policy);
- `float32` otherwise: on CPUs (float16 convolutions fall back to slow kernels there;
  bfloat16 is measured in docs/benchmarks.md but not chosen automatically), on older
  GPUs, and at level O0, which stays plain Keras.
"""

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
CHOICES = ("auto", *POLICIES)
AUTO_LEVELS = ("O1", "O2")


def choose_policy(precision, level, compute_capabilities):
    """The Keras dtype policy name for `precision` at boost `level` on GPUs of `compute_capabilities`.

    Pure (no TensorFlow): the rule of `resolve_precision`.

    Args:
        precision: "auto" or one of POLICIES (returned unchanged).
        level: the boost level, "O0", "O1" or "O2" (None counts as "O0").
        compute_capabilities: one `(major, minor)` per visible GPU; empty on a CPU machine.
    """
    if precision not in CHOICES:
        raise ValueError(f"precision must be one of {CHOICES}, got {precision!r}")
    if precision != "auto":
        return precision
    capabilities = [tuple(c) if c else None for c in compute_capabilities]
    if (level or "O0") not in AUTO_LEVELS or not capabilities or None in capabilities:
        return "float32"
    lowest = min(capabilities)
    if lowest >= (8, 0):
        return "mixed_bfloat16"
    if lowest >= (7, 0):
        return "mixed_float16"
    return "float32"


def gpu_compute_capabilities():
    """`(major, minor)` of every GPU TensorFlow uses in this process (after pinning: one)."""
    import tensorflow as tf

    found = []
    for device in tf.config.get_visible_devices("GPU"):
        capability = tf.config.experimental.get_device_details(device).get("compute_capability")
        found.append(tuple(capability) if capability else None)
    return found


def resolve_precision(precision, level):
    """`choose_policy` on this process's GPUs; call after `distributed.init()` (GPU pinning)."""
    if precision != "auto":
        return choose_policy(precision, level, [])
    return choose_policy(precision, level, gpu_compute_capabilities())
