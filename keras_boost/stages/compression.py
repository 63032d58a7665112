"""Gradient compression on the wire: float32 gradients travel as float16 or bfloat16.

Horovod's `hvd.Compression.fp16` (MindSpore has no compression). The stage owns two hooks
of the step: `encode` casts the gradients right before `reduce` and `decode` casts the
reduced gradients back right after it, so it compresses whatever reduces them: the
default fused allreduce, each `gradient_split_groups` bucket, AdaSum's in-group average
and the hierarchical allreduce. With gradient accumulation it runs once per update, at
the window boundary. In a single process there is no wire: the stage does nothing.

Overflow decisions (loss scale, NaN guard) must still see the true gradients after
compression:

- A finite value never becomes infinite. The collectives sum the workers' values before
  they divide (Horovod's Average is a sum, then a scale), in the wire dtype, rounding after
  every addition; each finite value is saturated to `saturation_bound(dtype, workers)`
  (`(max - workers_minus_1 * half_ulp(max)) / workers`, rounded down: 32736 for float16 on
  2 workers, about 65504 / workers), so no partial sum of `workers` of them can overflow.
- A non-finite value stays non-finite: inf and nan pass through the cast and the sum.

So the averaged gradient is non-finite exactly when some worker's true gradient is.

Precision: float16 keeps 11 significant bits and flushes |g| < 2**-24 (about 6e-8) to zero
(values below 6.1e-5 are subnormal and lose bits), which is why it is best combined with
loss scaling; bfloat16 keeps float32's range but only 8 significant bits. Horovod 0.28.1
cannot sum bfloat16 (its allreduce takes uint8, int8, int32, int64, float16, float32,
float64), so bfloat16 gradients are gathered by every worker (`distributed.grouped_allreduce`)
and summed in float64: half the bytes of a float32 allreduce on 2 workers, as many on 4,
more beyond (a warning says so).
"""


import numpy as np
import tensorflow as tf

from keras_boost import distributed, _warnings
from keras_boost.core.contract import Stage, map_values

_ALIASES = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES = "'float16' (or 'fp16') or 'bfloat16' (or 'bf16')"
_ALLOWED = "None, False, 'float16' (or 'fp16'), 'bfloat16' (or 'bf16') or a GradientCompression"
_CAST = (tf.float32, tf.float64)  # only these gradients are compressed; others pass unchanged


def _numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes  # TensorFlow's own dependency

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def saturation_bound(dtype, workers):
    """The largest `dtype` value L such that summing `workers` values in [-L, L] stays finite.

    The sum may run in `dtype`, in any order, rounding after every addition: each rounding
    adds at most half an ulp of `dtype`'s largest value, so `workers * L + (workers - 1) *
    half_ulp(max) <= max` keeps every partial sum finite. `dtype` is "float16" or "bfloat16".
    """
    np_dtype = _numpy_dtype(dtype)
    info = np.finfo(np_dtype)
    largest = float(info.max)
    below = np.array([largest], np_dtype).view(np.uint16) - np.uint16(1)
    half_ulp = (largest - float(below.view(np_dtype)[0])) / 2
    bound = (largest - half_ulp * (workers - 1)) / workers
    value = np.array([bound], np.float64).astype(np_dtype)
    while float(value[0]) > bound:  # rounded up: take the next smaller value (positive, so the bits minus one)
        value = (value.view(np.uint16) - np.uint16(1)).view(np_dtype)
    return float(value[0])


def compress(grads, dtype, workers):
    """The wire form of `grads`: float32/float64 gradients saturated and cast to `dtype`.

    Finite values are clipped to +-`saturation_bound(dtype, workers)`; inf and nan are kept.
    Other gradients (float16, bfloat16, integers) and None pass unchanged.
    """
    wire = tf.as_dtype(dtype)
    bound = saturation_bound(dtype, workers)

    def one(g):
        if g is None or g.dtype not in _CAST:
            return g
        saturated = tf.where(tf.math.is_finite(g), tf.clip_by_value(g, -bound, bound), g)
        return tf.cast(saturated, wire)

    return [map_values(one, g) for g in grads]


def decompress(grads, dtypes):
    """`grads` cast back to `dtypes` (the dtypes `compress` saw), where they differ."""
    def back(dtype):
        return lambda g: g if g is None or g.dtype == dtype else tf.cast(g, dtype)

    return [map_values(back(dtype), g) for g, dtype in zip(grads, dtypes)]


def _dtype_of(g):
    if g is None:
        return None
    return g.values.dtype if isinstance(g, tf.IndexedSlices) else g.dtype


def check_dtype(name, value, allowed=_DTYPES):
    """`value` as "float16" or "bfloat16" (aliases "fp16", "bf16"); the message form of `_validation`."""
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")
    if value not in _ALIASES:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")
    return _ALIASES[value]


class GradientCompression(Stage):
    """Sends the gradients over the wire as float16 or bfloat16 (Horovod's `hvd.Compression.fp16`).

    Args:
        dtype: "float16" (or "fp16", default) or "bfloat16" (or "bf16").

    Only float32 and float64 gradients are compressed; they are cast back to their own dtype
    right after the reduction, before the overflow decision and the update. Finite values
    saturate at `saturation_bound(dtype, workers)` (about 65504 / workers for float16) and
    never become infinite on the wire; inf and nan stay non-finite, so a loss scale or the
    NaN guard still skips exactly the updates whose true gradients overflowed. float16 flushes
    |g| < 2**-24 (about 6e-8) to zero: combine it with loss scaling for small gradients.
    In a single process it does nothing.

    Example:
        >>> model.compile(optimizer="sgd", loss="mse", compression="float16")
    """

    option = "compression"
    option_help = ('"float16"/"fp16", "bfloat16"/"bf16" or a `GradientCompression`: the gradients cross the wire in '
                   'that dtype.')

    def __init__(self, dtype="float16"):
        self.dtype = check_dtype("dtype", dtype)
        self._dtypes = None  # the gradients' own dtypes, set by encode for the decode that follows

    @classmethod
    def add_cli_arguments(cls, groups):
        groups["communication"].add_argument(
            "--compression", choices=["none", "float16", "bfloat16"], default="none",
            help="gradients on the wire in this precision (decompressed before the update)")

    @classmethod
    def option_from_cli(cls, args):
        return None if getattr(args, "compression", "none") == "none" else args.compression

    @classmethod
    def from_option(cls, value, model):
        """`compile(compression=...)`: None/False, "float16"/"fp16", "bfloat16"/"bf16" or a GradientCompression."""
        if value is None or value is False:
            return None
        if isinstance(value, GradientCompression):
            return value
        return cls(check_dtype("compression", value, _ALLOWED))

    def build(self, context):
        workers = distributed.size()
        if self.dtype == "bfloat16" and workers > 4:
            _warnings.warn(f"bfloat16 compression on {workers} workers sends more bytes than a float32 allreduce: "
                           "Horovod 0.28.1 cannot sum bfloat16, so every worker gathers the others' gradients; "
                           "use compression='float16'", UserWarning)

    def encode(self, grads, indices):
        self._dtypes = [_dtype_of(g) for g in grads]
        workers = distributed.size()
        if workers == 1:
            return grads
        return compress(grads, self.dtype, workers)

    def decode(self, grads, indices):
        dtypes, self._dtypes = self._dtypes, None
        if distributed.size() == 1 or dtypes is None:
            return grads
        return decompress(grads, dtypes)

    def get_config(self):
        return {"dtype": self.dtype}
