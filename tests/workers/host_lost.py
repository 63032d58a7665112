"""A host drops off the network mid-run; a relaunch resumes from the last whole backup.

argv[1] = "train": 2 workers (one per host) train 4 epochs with a BackupAndRestore backup
at every epoch end (argv[2]). After the backup of epoch 1, rank 0 writes the marker file
$KB_LINK_MARKER and waits (at most 60 s) for "$KB_LINK_MARKER.down", which the test writes
once it has taken the other host's link down; training then goes on into a step whose
allreduce can never complete. The job must end within the stall bound, naming the lost
rank and host.
argv[1] = "resume": the same script with the same backup directory (the link is up again)
resumes, then trains a fresh model for the 4 epochs without interruption; it reports the
epochs the resumed run trained and both weight hashes.
"""

import hashlib
import os
import sys
import time

from common import report

import keras

from keras_boost import BoostModel, callbacks, distributed
from tests.helpers import classification_data, compile_sgd, mlp, weights

MODE, BACKUP = sys.argv[1], sys.argv[2]
MARKER = os.environ.get("KB_LINK_MARKER", "")


class LoseTheLink(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if MODE == "train" and epoch == 1 and distributed.rank() == 0:
            time.sleep(8)  # the workers have run a while (their watchdogs published, beat twice) before the cut
            with open(MARKER, "w") as handle:
                handle.write(str(time.time()))
            deadline = time.monotonic() + 60
            while not os.path.exists(MARKER + ".down") and time.monotonic() < deadline:
                time.sleep(0.2)
            print(f"host_lost: the link is down at {time.time():.2f}; rank 0 goes on into epoch 2", flush=True)


def digest(model):
    return hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()


def train(backup_dir=None):
    rank, size = distributed.rank(), distributed.size()
    x, y = classification_data(n=256)
    xs, ys = x[rank::size], y[rank::size]
    model = compile_sgd(mlp(BoostModel))
    watch = LoseTheLink()
    extra = [callbacks.BackupAndRestore(backup_dir)] if backup_dir else []
    model.fit(xs, ys, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=extra + [watch])
    return model, watch.seen


def main():
    distributed.init()
    resumed, seen = train(BACKUP)
    if MODE == "resume":
        uninterrupted, _ = train()
        report(distributed.rank(), epochs=seen, resumed=digest(resumed), uninterrupted=digest(uninterrupted))
    else:
        report(distributed.rank(), finished=True)  # never reached: the link is down


if __name__ == "__main__":
    main()
