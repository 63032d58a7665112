"""keras_boost's Keras callbacks (Horovod's, for Keras 3): `from keras_boost.callbacks import BackupAndRestore`.

They live in `keras_boost/fit/callbacks.py`, with the rest of what keras_boost adds around `fit`.
"""

from keras_boost.fit.callbacks import *  # noqa: F403
from keras_boost.fit.callbacks import __all__  # noqa: F401
