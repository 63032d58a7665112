"""Workers with different amounts of data: 64 and 48 samples (batch 16), 40 and 24 for validation.

Each mode trains a fresh model for 2 epochs (shuffle off) and reports a hash of the
weights, the optimizer's iteration count, the largest difference to a plain Keras model
trained on one process on the batches that were used (each global step = rank 0's
batch k and rank 1's batch k, the common 3 batches per epoch), the validation logs and
their difference to a plain Keras evaluation of all validation samples of both ranks.

Modes (argv[1], comma-separated): numpy, numpy_shuffled (fit's default shuffle: no
reference, the ranks still agree), dataset (tf.data of unknown cardinality), pydataset
(keras.utils.PyDataset of known, different lengths). Each reports the steps fit knew at each
epoch's start and the UserWarnings fit gave.
"""

import hashlib
import sys
import time
import warnings

from common import report

import keras
import numpy as np
import tensorflow as tf

from keras_boost import BoostModel, distributed
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights

BATCH = 16
SIZES = {0: 64, 1: 48}
VAL_SIZES = {0: 40, 1: 24}


def shard(x, sizes, rank):
    start = sum(sizes[r] for r in range(rank))
    return x[start:start + sizes[rank]]


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return int(np.ceil(len(self.x) / BATCH))

    def __getitem__(self, index):
        return self.x[index * BATCH:(index + 1) * BATCH], self.y[index * BATCH:(index + 1) * BATCH]


class EpochLengths(keras.callbacks.Callback):
    """The number of steps Keras' fit knows at the start of each epoch (None: unknown)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(self.params.get("steps"))


def reference(x, y, xv, yv):
    """Plain Keras on one process: global batch k = rank 0's batch k + rank 1's batch k, 3 per epoch."""
    steps = min(SIZES.values()) // BATCH
    parts = []
    for k in range(steps):
        for r in (0, 1):
            parts.append(np.arange(k * BATCH, (k + 1) * BATCH) + sum(SIZES[q] for q in range(r)))
    rows = np.concatenate(parts)
    model = compile_sgd(mlp(keras.Model, seed=0))
    model.fit(x[rows], y[rows], batch_size=2 * BATCH, epochs=2, shuffle=False, verbose=0)
    val = model.evaluate(xv, yv, batch_size=8, verbose=0, return_dict=True)
    return model, val


def run(modes="numpy,dataset,pydataset"):
    distributed.init()
    rank = distributed.rank()
    modes = modes.split(",")
    x, y = classification_data(n=sum(SIZES.values()))
    xv, yv = classification_data(n=sum(VAL_SIZES.values()), seed=2)
    ref_model, ref_val = reference(x, y, xv, yv)
    xs, ys = shard(x, SIZES, rank), shard(y, SIZES, rank)
    val = (shard(xv, VAL_SIZES, rank), shard(yv, VAL_SIZES, rank))
    out = {}
    for mode in modes:
        model = compile_sgd(mlp(BoostModel, seed=0))
        lengths = EpochLengths()
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "numpy":
                history = model.fit(xs, ys, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                                    validation_data=val, callbacks=[lengths])
            elif mode == "dataset":
                ds = tf.data.Dataset.from_tensor_slices((xs, ys)).filter(lambda a, b: True).batch(BATCH)
                assert int(ds.cardinality()) == tf.data.UNKNOWN_CARDINALITY
                vds = tf.data.Dataset.from_tensor_slices(val).filter(lambda a, b: True).batch(8)
                history = model.fit(ds, epochs=2, verbose=0, validation_data=vds, callbacks=[lengths])
            elif mode == "pydataset":
                history = model.fit(Batches(xs, ys), epochs=2, shuffle=False, verbose=0, validation_data=val,
                                    callbacks=[lengths])
            elif mode == "numpy_shuffled":  # Keras' default shuffle=True: each rank reshuffles its shard
                history = model.fit(xs, ys, batch_size=BATCH, epochs=2, verbose=0, validation_data=val,
                                    callbacks=[lengths])
            else:
                raise ValueError(mode)
        seconds = time.monotonic() - start
        evaluation = model.evaluate(val[0], val[1], batch_size=8, verbose=0, return_dict=True, across_workers=True)
        digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()
        out[mode] = {
            "digest": digest, "iterations": int(model.optimizer.iterations.numpy()),
            "diff": max_diff(weights(ref_model), weights(model)), "seconds": seconds,
            "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
            "evaluation": {k: float(v) for k, v in evaluation.items()},
            "evaluation_diff": max(abs(evaluation[k] - ref_val[k]) for k in ref_val),
            "epoch_steps": lengths.steps,
            "warnings": sorted({str(w.message)[:80] for w in caught if issubclass(w.category, UserWarning)}),
        }
    return out


def main():
    values = run(*sys.argv[1:])
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
