"""Keras optimizers from keras_boost, usable with any `keras.Model`."""

from keras_boost.optimizers.centralization import CentralizedOptimizer

__all__ = ["CentralizedOptimizer"]
