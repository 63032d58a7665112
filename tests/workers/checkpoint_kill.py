"""Rank 0 is SIGKILLed while it writes a BackupAndRestore backup; a relaunch resumes from the last whole one.

argv[1] = "crash": 2 workers train 4 epochs with a backup at every epoch end; at the end
of epoch 2 rank 0 writes half of the new weights file and kills itself before the
rename (the state of a machine that dies in the middle of the write).
argv[1] = "resume": the same script with the same backup directory (argv[2]) resumes,
and then trains a fresh model for the 4 epochs without interruption; it reports the
epochs the resumed run trained and both weight hashes.
"""

import hashlib
import os
import signal
import sys
import time

from common import report

import keras

from keras_boost import BoostModel, callbacks, distributed
from tests.helpers import classification_data, compile_sgd, mlp, weights

MODE, BACKUP = sys.argv[1], sys.argv[2]


class DieWhileWriting(callbacks.BackupAndRestore):
    def _save_model(self):
        if MODE == "crash" and self._current_epoch == 3 and distributed.rank() == 0:
            real = self.model.save_weights

            def half_then_die(path, overwrite=True):
                real(path, overwrite=overwrite)
                size = os.path.getsize(path)
                with open(path, "r+b") as handle:
                    handle.truncate(size // 2)
                print(f"checkpoint_kill: rank 0 dies while writing {os.path.basename(path)} "
                      f"({size // 2} of {size} bytes) at {time.time():.2f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            self.model.save_weights = half_then_die
        super()._save_model()


class Epochs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(epoch)


def digest(model):
    return hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()


def train(backup_dir=None):
    rank, size = distributed.rank(), distributed.size()
    x, y = classification_data(n=256)
    xs, ys = x[rank::size], y[rank::size]
    model = compile_sgd(mlp(BoostModel))
    epochs = Epochs()
    extra = [DieWhileWriting(backup_dir)] if backup_dir else []
    model.fit(xs, ys, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=extra + [epochs])
    return model, epochs.seen


def main():
    distributed.init()
    resumed, seen = train(BACKUP)
    if MODE == "resume":
        uninterrupted, _ = train()
        report(distributed.rank(), epochs=seen, resumed=digest(resumed), uninterrupted=digest(uninterrupted))


if __name__ == "__main__":
    main()
