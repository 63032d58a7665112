"""Reentrant, thread-safe swaps of a layer's method for an instance attribute.

The `around_forward` stages (the fused BatchNorm, the one-pixel matrix products) change what
a layer computes only while the boost step's forward pass runs: they set an instance
attribute that hides the class's method (`call`, `convolution_op`) and delete it on exit.
Freeze groups traced ahead in a background thread enter the same swap while the main
thread may be inside it too; the first one in sets the attribute and the last one out
removes it, so Keras' method is back once every forward pass has left.
"""

import contextlib
import threading

_LOCK = threading.Lock()
_ENTERED = {}  # (id(layer), attribute) -> how many forward passes use the swapped attribute


@contextlib.contextmanager
def swapped(layers, attribute, make):
    """While inside, `attribute(layer)` of each of `layers` is the instance attribute `make(layer)`."""
    keys = [(layer, attribute(layer)) for layer in layers]
    with _LOCK:
        for layer, name in keys:
            if _ENTERED.get((id(layer), name), 0) == 0:
                object.__setattr__(layer, name, make(layer))
            _ENTERED[(id(layer), name)] = _ENTERED.get((id(layer), name), 0) + 1
    try:
        yield
    finally:
        with _LOCK:
            for layer, name in keys:
                _ENTERED[(id(layer), name)] -= 1
                if _ENTERED[(id(layer), name)] == 0:
                    del _ENTERED[(id(layer), name)]
                    object.__delattr__(layer, name)
