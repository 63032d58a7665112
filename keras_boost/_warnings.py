"""keras_boost's warnings point at the user's line: the first caller outside keras_boost, Keras and TensorFlow.

A warning raised in `fit` or `compile` would otherwise name a line of Keras' trainer, and
Python's `stacklevel` cannot say how deep the user's line is (it depends on which Keras
method called which hook). Where no such caller exists (a background thread), the warning
names the line that raised it.
"""

import importlib.util
import os
import sys
import warnings


def _package_folders():
    folders = [os.path.dirname(os.path.abspath(__file__))]
    for name in ("keras", "tensorflow", "tf_keras"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders += [os.path.abspath(path) for path in spec.submodule_search_locations]
    return tuple(folder + os.sep for folder in folders)


_INTERNAL = _package_folders()


def _internal(filename):
    return os.path.abspath(filename).startswith(_INTERNAL) or filename.startswith("<frozen ")


def warn(message, category=UserWarning):
    """`warnings.warn(message, category)` attributed to the user's line."""
    frame = sys._getframe(1)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__"),
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=module_globals)
