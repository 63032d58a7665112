"""Exponential moving average of the weights (`compile(ema=...)`): evaluation sees the average, the model ends with it.

After every update, each trainable weight's average moves towards it,
`average = decay * average + (1 - decay) * weight`, with TensorFlow's warm-up
(`tf.train.ExponentialMovingAverage(num_updates=...)`): the n-th update uses
`min(decay, (1 + n) / (10 + n))`, and the first takes the weights as they are, so the
average follows the early weights closely instead of remembering the initialisation
(Keras' `use_ema` has no warm-up: its first epochs evaluate far below the weights'
accuracy). The average runs inside the compiled step, one pass over the weights.

Where the average is used, as Keras' `SwapEMAWeights(swap_on_epoch=True)` and Composer's
`EMA` use it: `fit`'s validation, the callbacks at each epoch's end (a `ModelCheckpoint`,
an evaluation in a callback) and the model once `fit` has returned (`evaluate`, `predict`,
`save`) see the averaged weights; each epoch trains the weights being trained. The swap
is in place (the weights and their averages trade values) and its side is boost state,
like the averages: `BackupAndRestore` resumes exactly, a `.keras` file holds both, and a
later `fit` trains on from the trained weights, not from the average. BatchNorm's moving
statistics are not averaged (Keras' `use_ema` leaves them too): they already are moving
averages, of the statistics under the trained weights.

Every worker holds the same average (the weights it averages are identical). MindSpore's
`mindspore.boost` has no such feature; it is one of Composer's methods (`composer.algorithms.EMA`)
and `tf.train.ExponentialMovingAverage` for TensorFlow.
"""

import numbers

import keras
import tensorflow as tf

from keras_boost.core.contract import Stage


class ExponentialMovingAverage(Stage):
    """Keeps an exponential moving average of the trainable weights; evaluation uses it, the model ends with it.

    Args:
        decay: the average's decay per update, in (0, 1): 0.99 remembers about the last 100
            updates. Default 0.99.
        warmup: whether the n-th update decays by `min(decay, (1 + n) / (10 + n))`
            (TensorFlow's `num_updates`), so the average starts from the trained weights'
            recent values. Default True.

    Example:
        >>> model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", ema=0.99)
        >>> model.fit(x, y, validation_data=(x_val, y_val), epochs=5)  # val_ numbers: the average's
        >>> model.evaluate(x_test, y_test)                              # the average's weights
    """

    option = "ema"
    option_help = ("True (decay 0.99), a decay in (0, 1) or an `ExponentialMovingAverage`: an exponential moving "
                   "average of the trainable weights, updated after every update; validation, epoch-end callbacks "
                   "and the model after `fit` use it (on at O2).")
    option_values = "None, a bool, a float in (0, 1)"
    on_with_true = True
    number_argument = "decay"

    def __init__(self, decay=0.99, warmup=True):
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real):
            raise TypeError(f"`decay` must be a float in (0, 1), got {decay!r} ({type(decay).__name__}).")
        if not 0.0 < float(decay) < 1.0:
            raise ValueError(f"`decay` must be in (0, 1) (0.99 remembers about the last 100 updates), got {decay!r}.")
        if not isinstance(warmup, bool):
            raise TypeError(f"`warmup` must be a bool, got {warmup!r} ({type(warmup).__name__}).")
        self.decay = float(decay)
        self.warmup = warmup
        self.count = self.swapped = None
        self.average = []

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """On at O2, unless `"boost": {"ema": False}`."""
        return cls() if boost_config.ema and not validate else None

    @classmethod
    def add_cli_arguments(cls, groups):
        groups["training"].add_argument("--ema", type=_decay_arg, default=None, metavar="DECAY",
                                        help="an exponential moving average of the weights with this decay per "
                                        "update, in (0, 1); validation and the trained model use it (docs/ema.md)")

    @classmethod
    def option_from_cli(cls, args):
        return getattr(args, "ema", None)

    def get_config(self):
        return {"decay": self.decay, "warmup": self.warmup}

    def build(self, context):
        self.variables = list(context.variables)
        self.count = context.state.add_state("ema/count", 0, "int64")
        self.swapped = context.state.add_state("ema/swapped", 0, "int64")  # 1: the model holds the average
        self.average = context.state.add_slots("ema", self.variables)

    def after_update(self):
        n = tf.cast(self.count, tf.float32)
        decay = tf.minimum(self.decay, (1.0 + n) / (10.0 + n)) if self.warmup else tf.constant(self.decay)
        decay = tf.where(self.count > 0, decay, 0.0)  # the first update: the weights themselves
        for average, variable in zip(self.average, self.variables):
            value = tf.convert_to_tensor(variable)
            average.assign(value + tf.cast(decay, value.dtype) * (average - value))
        self.count.assign_add(1)

    # ------------------------------------------------------------ lifecycle
    def swap(self, averaged):
        """Puts the average in the model's weights (`averaged=True`) or the trained weights back; eager."""
        if self.count is None or bool(self.swapped.numpy()) == averaged or (averaged and int(self.count.numpy()) == 0):
            return
        for average, variable in zip(self.average, self.variables):
            trained = tf.identity(variable)
            variable.assign(average)
            average.assign(trained)
        self.swapped.assign(int(averaged))

    def fit_callbacks(self):
        return [_SwapAverage(self)]

    def after_fit(self, model, batches):
        self.swap(True)

    def report(self, step):
        return {"ema_updates": int(self.count.numpy())} if self.count is not None else {}


def _decay_arg(text):
    """argparse type of `--ema`: a decay in (0, 1)."""
    import argparse

    try:
        return ExponentialMovingAverage(decay=float(text)).decay
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).replace("`decay`", "--ema")) from None


class _SwapAverage(keras.callbacks.Callback):
    """Each epoch trains the trained weights; from its validation on (Keras validates at the epoch's
    end, before the epoch-end callbacks) the model holds the average until the next epoch starts."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def on_epoch_begin(self, epoch, logs=None):
        self.stage.swap(False)

    def on_test_begin(self, logs=None):
        self.stage.swap(True)

    def on_epoch_end(self, epoch, logs=None):
        self.stage.swap(True)
