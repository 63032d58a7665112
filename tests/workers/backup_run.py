"""The run that the fault-then-resume workers share (checkpoint_kill.py, host_lost.py).

2 workers train the test MLP for 4 epochs on their halves of 256 rows, with a
`BackupAndRestore` backup at every epoch end when given one; `resume_or_fault` runs the
worker's mode: "resume" resumes from the backup, then trains a fresh model without
interruption and reports the epochs the resumed run trained and both weight hashes.
"""

import hashlib

from common import report

import keras

from keras_boost import BoostModel, distributed
from tests.helpers import classification_data, compile_sgd, mlp, weights


class Epochs(keras.callbacks.Callback):
    """Records the epochs a fit runs (a resumed fit starts after the last backed-up one)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(epoch)


def digest(model):
    return hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()


def train(backup=None, extra=()):
    """(model, epochs run): 4 epochs with `backup` (a BackupAndRestore callback or None) first."""
    rank, size = distributed.rank(), distributed.size()
    x, y = classification_data(n=256)
    xs, ys = x[rank::size], y[rank::size]
    model = compile_sgd(mlp(BoostModel))
    epochs = Epochs()
    callbacks = ([backup] if backup is not None else []) + [epochs, *extra]
    model.fit(xs, ys, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
    return model, epochs.seen


def resume_or_fault(mode, backup, extra=()):
    """Trains with `backup` (the fault happens inside, in `mode` != "resume"); on "resume"
    also trains without interruption and reports both weight hashes."""
    distributed.init()
    resumed, seen = train(backup, extra)
    if mode == "resume":
        uninterrupted, _ = train()
        report(distributed.rank(), epochs=seen, resumed=digest(resumed), uninterrupted=digest(uninterrupted))
    else:
        report(distributed.rank(), finished=True)  # not reached when the fault ends the job
