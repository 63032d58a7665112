"""A backup on the first host's disk alone: Keras' own BackupAndRestore in a script written for one machine.

argv[1] = "train": 2 workers (one per host) train the test MLP with
`keras.callbacks.BackupAndRestore(argv[2], delete_checkpoint=False)` and a `CSVLogger`
(argv[3]/log.csv, appended), and stop after epoch 1 (the backup then says epoch 2).
argv[1] = "resume": the same script resumes from that backup, where only rank 0's host
sees it (the test hides the folder on the other host); then trains a fresh model for the 4
epochs without interruption. Each rank reports whether it saw the backup, the epochs the
resumed run trained and both weight hashes.
"""

import os
import sys

from backup_run import digest, train
from common import report

import keras

from keras_boost import distributed

MODE, BACKUP, OUT = sys.argv[1], sys.argv[2], sys.argv[3]


class StopAfterEpoch1(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.model.stop_training = True


def main():
    distributed.init()
    sees = os.path.exists(os.path.join(BACKUP, "latest.weights.h5"))
    backup = keras.callbacks.BackupAndRestore(BACKUP, delete_checkpoint=MODE == "resume")
    extra = [keras.callbacks.CSVLogger(f"{OUT}/log.csv", append=True)]
    resumed, seen = train(backup, extra + ([StopAfterEpoch1()] if MODE == "train" else []))
    values = dict(sees_backup=sees, epochs=seen, resumed=digest(resumed))
    if MODE == "resume":
        values["uninterrupted"] = digest(train()[0])
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
