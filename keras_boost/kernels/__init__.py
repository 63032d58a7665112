"""keras_boost's own TensorFlow kernels: compiled at setup, loaded when a step first needs them.

One kernel so far, `KerasBoostCentredKerasMomentum` (`centred_momentum.cc`): gradient
centralization and Keras' SGD-with-momentum update in one pass over each kernel (the
centred gradient is never written out and read back). Boost levels use it where both
stages are on ([fused update](../../docs/fused_update.md)).

`scripts/setup.sh` builds the library (`python -m keras_boost.kernels.build`, about 20 s
with g++) next to this file, for the TensorFlow installed beside it. Where it is missing
or was built for another TensorFlow, `library()` returns None, `why_unavailable()` says
why (one warning per process where a step would have used it), and the stages keep their
TensorFlow-only form (the same results, one more pass over the gradients).

`KERAS_BOOST_NATIVE_KERNELS` in the environment: `auto` (the default: use the library when
it is built), `0` (never: the TensorFlow-only form), `1` (required: a missing library is a
`RuntimeError`). Any other value is a `ValueError`.
"""

import os
import threading

import tensorflow as tf

SOURCES = ("centred_momentum.cc",)
LIBRARY = "_keras_boost_kernels.so"
STAMP = LIBRARY + ".stamp"
_ENV = "KERAS_BOOST_NATIVE_KERNELS"

_lock = threading.Lock()
_loaded = {}  # "library": the loaded module or None; "why": the reason when None


def directory():
    return os.path.dirname(os.path.abspath(__file__))


def stamp():
    """What a built library must have been built from: TensorFlow's version and the sources' bytes."""
    import hashlib

    digest = hashlib.sha256(tf.__version__.encode())
    for name in SOURCES:
        with open(os.path.join(directory(), name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def mode():
    """`KERAS_BOOST_NATIVE_KERNELS`: "auto", "0" or "1"."""
    value = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{_ENV}={os.environ.get(_ENV)!r}: use auto (the default: the kernels when built), "
                         "0 (never) or 1 (required).")
    return value


def library():
    """The loaded op library, or None (see `why_unavailable`). Loaded once per process."""
    if mode() == "0":
        return None
    with _lock:
        if "library" not in _loaded:
            _loaded["library"], _loaded["why"] = _load()
    if _loaded["library"] is None and mode() == "1":
        raise RuntimeError(f"{_ENV}=1, but keras_boost's kernels cannot be loaded: {_loaded['why']}")
    return _loaded["library"]


def why_unavailable():
    """None when `library()` is loaded; otherwise a sentence saying why not."""
    if mode() == "0":
        return f"{_ENV}=0"
    if library() is not None:
        return None
    return _loaded["why"]


def _load():
    path = os.path.join(directory(), LIBRARY)
    if not os.path.exists(path):
        return None, f"{path} is not built (scripts/setup.sh builds it: python -m keras_boost.kernels.build)"
    try:
        with open(os.path.join(directory(), STAMP)) as f:
            built_from = f.read().strip()
    except OSError:
        built_from = None
    if built_from != stamp():
        return None, (f"{path} was built for another TensorFlow or other sources (rebuild it: "
                      "python -m keras_boost.kernels.build)")
    try:
        return tf.load_op_library(path), None
    except (tf.errors.NotFoundError, OSError) as error:  # a library the loader refuses (symbols, ABI)
        return None, f"{path} does not load: {error}"


def warn_once(consequence):
    """One warning per process where the library is wanted (`auto`) but cannot be loaded: `consequence`, and why."""
    if mode() != "auto" or _loaded.get("warned") or library() is not None:
        return
    _loaded["warned"] = True
    import warnings

    warnings.warn(f"keras_boost: {consequence}: {why_unavailable()}.", UserWarning, stacklevel=3)


def centred_keras_momentum(var, accum, lr, grad, sums, momentum, nesterov=False):
    """`grad - sums / n` and Keras' momentum update of `var` and `accum` (resource handles), in one kernel.

    `n` is `grad`'s number of values per output channel (the last axis); `sums` holds one
    value per channel. Raises `RuntimeError` where the library is not loaded.
    """
    ops = library()
    if ops is None:
        raise RuntimeError(f"keras_boost's kernels are not loaded: {why_unavailable()}")
    return ops.keras_boost_centred_keras_momentum(var=var, accum=accum, lr=lr, grad=grad, sums=sums,
                                                  momentum=momentum, use_locking=False,
                                                  use_nesterov=bool(nesterov))
