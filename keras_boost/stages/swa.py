"""Stochastic weight averaging (`compile(swa=...)`): the model ends as the average of its last epochs' weights.

As PyTorch's `torch.optim.swa_utils` does it (Izmailov et al., 2018, "Averaging Weights Leads
to Wider Optima and Better Generalization"): from a start epoch on, the trainable weights at
each epoch's end are added to a running average; when `fit` returns, the model's weights
become that average and every BatchNormalization's moving statistics are recomputed for
them by one pass over the training data (`update_bn`), since statistics gathered under the
weights of the trajectory do not fit their average. `evaluate`, `predict` and `save` after
`fit` then use the averaged model. Validation inside `fit`, and checkpoints written during
it, see the weights being trained.

The average and its count are boost state: `BackupAndRestore` resumes them, a `.keras` file
holds them, and every worker holds the same ones (the weights they average are identical,
and the recomputed BatchNorm statistics are the mean over every worker's batches). The compiled step is
unchanged: the averaging runs between epochs, the BatchNorm pass after `fit`.

MindSpore's `mindspore.boost` has no such feature; PyTorch Lightning's
`StochasticWeightAveraging` callback is the same method for PyTorch.
"""

import numbers
import sys

import keras
import tensorflow as tf

from keras_boost import _keras_compat, _warnings, distributed
from keras_boost.core.contract import Stage


class StochasticWeightAveraging(Stage):
    """Averages the trainable weights at each epoch's end from `start` on; the average replaces them after `fit`.

    Args:
        start: where the averaging starts. A float in [0, 1): that fraction of the fit's
            epochs passes first (0.75 of 20 epochs: the last 5 are averaged, as PyTorch
            Lightning's `swa_epoch_start`); an int >= 0: the epoch index, counted as Keras'
            `initial_epoch` counts (7: from the progress bar's "Epoch 8/...").
        batchnorm_pass: whether the BatchNorm statistics are recomputed for the averaged
            weights by a pass over the training data when `fit` returns (PyTorch's `update_bn`).

    Example:
        >>> model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        ...               loss="sparse_categorical_crossentropy", swa=0.75)
        >>> model.fit(x, y, epochs=20)   # the weights are now the average of epochs 16-20
    """

    option = "swa"
    option_help = ("True (the last quarter of the fit's epochs), a start (a fraction of the epochs in [0, 1), or an "
                   "epoch index) or a `StochasticWeightAveraging`: the model ends as the average of the weights at "
                   "those epochs' ends, BatchNorm statistics recomputed for it.")
    option_values = "None, a bool, a float in [0, 1), an int >= 0"
    on_with_true = True
    number_argument = "start"

    def __init__(self, start=0.75, batchnorm_pass=True):
        if isinstance(start, bool) or not isinstance(start, numbers.Real):
            raise TypeError(f"`start` must be a float in [0, 1) (a fraction of the fit's epochs) or an int >= 0 "
                            f"(an epoch index), got {start!r} ({type(start).__name__}).")
        if isinstance(start, numbers.Integral):
            if start < 0:
                raise ValueError(f"`start` as an epoch index must be >= 0, got {start}.")
            start = int(start)
        elif not 0.0 <= float(start) < 1.0:
            raise ValueError(f"`start` as a fraction of the fit's epochs must be in [0, 1), got {start!r}; "
                             "an int names an epoch index.")
        else:
            start = float(start)
        if not isinstance(batchnorm_pass, bool):
            raise TypeError(f"`batchnorm_pass` must be a bool, got {batchnorm_pass!r} ({type(batchnorm_pass).__name__}).")
        self.start = start
        self.batchnorm_pass = batchnorm_pass
        self.average = None
        self.count = None

    @classmethod
    def add_cli_arguments(cls, groups):
        groups["training"].add_argument("--swa", type=_start_arg, default=None, metavar="START",
                                        help="stochastic weight averaging from START: a fraction of the epochs "
                                        "in [0, 1) (0.75: the last quarter) or an epoch index (docs/swa.md)")

    @classmethod
    def option_from_cli(cls, args):
        return getattr(args, "swa", None)

    def get_config(self):
        return {"start": self.start, "batchnorm_pass": self.batchnorm_pass}

    def build(self, context):
        self.variables = list(context.variables)
        self.count = context.state.add_state("swa/count", 0, "int64")
        self.average = context.state.add_slots("swa", self.variables)

    def start_epoch(self, epochs):
        """The first epoch index averaged in a fit of `epochs` epochs."""
        return self.start if isinstance(self.start, int) else int(self.start * epochs)

    # ------------------------------------------------------------ lifecycle
    def fit_callbacks(self):
        return [_AverageAtEpochEnd(self)]

    def add_to_average(self):
        """average += (weights - average) / (count + 1), for every trainable variable; eager."""
        n = float(self.count.numpy())
        for average, variable in zip(self.average, self.variables):
            average.assign(average + (variable - average) / (n + 1.0))
        self.count.assign_add(1)

    def after_fit(self, model, batches):
        if self.count is None:  # no step ran, so the stage was never built
            return
        averaged = int(self.count.numpy())
        if averaged == 0:
            _warnings.warn("swa: no epoch's weights were averaged in this fit (its epochs ended before the start, "
                           f"{self.start!r}), so the model keeps its last weights", UserWarning)
            return
        for variable, average in zip(self.variables, self.average):
            variable.assign(average)
        passes = recompute_batchnorm_statistics(model, batches()) if self.batchnorm_pass else None
        if distributed.rank() == 0:
            line = f"keras_boost: swa: the weights are now the average of {averaged} epoch ends"
            if passes is not None:
                line += f"; BatchNorm statistics recomputed over {passes} batches" if passes else \
                    "; the model has no trainable BatchNormalization"
            print(line, file=sys.stderr, flush=True)

    def report(self, step):
        return {"swa_epochs_averaged": int(self.count.numpy())} if self.count is not None else {}


def _start_arg(text):
    """argparse type of `--swa`: an int (an epoch index) or a float in [0, 1)."""
    import argparse

    try:
        value = int(text) if text.strip().isdigit() else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1) or an epoch index >= 0, got {text!r}") from None
    try:
        StochasticWeightAveraging(start=value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


class _AverageAtEpochEnd(keras.callbacks.Callback):
    """Adds the weights to the average at the end of every epoch from the start on."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage
        self.start = 0

    def on_train_begin(self, logs=None):
        self.start = self.stage.start_epoch(self.params.get("epochs") or 0)

    def on_epoch_end(self, epoch, logs=None):
        if epoch >= self.start and self.stage.count is not None:
            self.stage.add_to_average()


def recompute_batchnorm_statistics(model, batches):
    """Sets every trainable BatchNormalization's moving mean and variance to their averages over
    the batch statistics of `batches` (inputs, in training mode), as PyTorch's `update_bn`, over
    every worker's batches (a worker with fewer weighs less). Returns the number of batches this worker read (0: no such layer, nothing read)."""
    layers = [layer for layer in _keras_compat.flatten_layers(model)
              if isinstance(layer, keras.layers.BatchNormalization) and layer.built and layer.trainable]
    if not layers:
        return 0
    statistics = [v for layer in layers for v in (layer.moving_mean, layer.moving_variance)]
    momenta = [layer.momentum for layer in layers]

    def add_batch(state, x):  # one reduction in the graph: no Python round trip per batch
        sums, count = state
        model(x, training=True)
        return tuple(s + tf.identity(v) for s, v in zip(sums, statistics)), count + 1  # after the call's updates

    try:
        for layer in layers:
            layer.momentum = 0.0  # each call leaves the batch's own statistics in the moving ones
        sums, count = batches.reduce((tuple(tf.zeros_like(v) for v in statistics), tf.constant(0, tf.int64)),
                                     add_batch)
    finally:
        for layer, momentum in zip(layers, momenta):
            layer.momentum = momentum
    local, count = int(count), tf.cast(count, sums[0].dtype)
    if distributed.size() > 1:  # every worker's batches weigh the same, whatever its shard's length
        *sums, count = distributed.grouped_allreduce([*sums, count], average=False)
    if float(count):
        for variable, total in zip(statistics, sums):
            variable.assign(total / count)
    return local
