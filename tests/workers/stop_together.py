"""Callbacks that stop training on one worker only: every worker must stop after the same batch.

Fits of 4 epochs of 16 steps on 2 workers:
- "rank0_mid_epoch": a callback sets `model.stop_training` on rank 0 only, at batch 3 of epoch 1;
- "rank1_epoch_end": a callback sets it on rank 1 only, in `on_epoch_end` of epoch 2;
- "early_stopping": Keras' EarlyStopping on the (shared) epoch loss, patience 0, min_delta huge;
- "rank1_mid_epoch_each": rank 1 at batch 5 of epoch 0, with one allreduce per gradient
  (`gradient_split_groups="each"`: the vote is an allreduce of its own, fused by Horovod);
- "rank0_accumulating": rank 0 at batch 2 of epoch 0 with 2 micro-batches per update (the
  vote rides on the update at batch 3);
- "rank1_at_batch_0": rank 1 asks before the first batch (`on_train_begin`).
Without agreement the worker that stopped would leave the other waiting in the next step's
allreduce until the stall timeout. Per rank: epochs run, batches run, optimizer iterations,
a weight digest, `model.stop_training` after fit, and the collectives the steps ran (the
launch counts them: KERAS_BOOST_COUNT_COLLECTIVES=1).
"""

import hashlib

import keras
import numpy as np

from keras_boost import distributed
from tests.helpers import classification_data, compile_sgd, mlp, weights


class StopOn(keras.callbacks.Callback):
    def __init__(self, rank, epoch, batch=None):
        super().__init__()
        self.rank, self.epoch, self.batch, self.current = rank, epoch, batch, None

    def on_train_begin(self, logs=None):
        if self.epoch is None and distributed.rank() == self.rank:
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.batch is not None and distributed.rank() == self.rank and (self.current, batch) == (self.epoch, self.batch):
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self.batch is None and self.epoch is not None and distributed.rank() == self.rank and epoch == self.epoch:
            self.model.stop_training = True


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


RUNS = (("rank0_mid_epoch", StopOn(0, 1, batch=3), {}),
        ("rank1_epoch_end", StopOn(1, 2), {}),
        ("early_stopping", keras.callbacks.EarlyStopping("loss", min_delta=100.0, patience=0), {}),
        ("rank1_mid_epoch_each", StopOn(1, 0, batch=5), {"gradient_split_groups": "each"}),
        ("rank0_accumulating", StopOn(0, 0, batch=2), {"gradient_accumulation": 2}),
        ("rank1_at_batch_0", StopOn(1, None), {}))


def run():
    distributed.init()
    x, y = classification_data(n=256)
    found = {}
    for name, callback, options in RUNS:
        model = compile_sgd(mlp(seed=0), **options)
        counted = CountBatches()
        before = distributed.allreduce_count()
        history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[callback, counted])
        collectives = distributed.allreduce_count() - before
        found[name] = dict(epochs=len(history.history["loss"]), batches=counted.batches,
                           iterations=int(model.optimizer.iterations.numpy()), stopped=bool(model.stop_training),
                           collectives=collectives,
                           digest=hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest())
    return found
