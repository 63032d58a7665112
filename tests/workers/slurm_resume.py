"""Under Slurm (srun --mpi=pmix): 2 workers train with a backup at every epoch's end.

argv: MODE BACKUP MARKER. MODE "train": after the backup of epoch 1, rank 0 writes MARKER and
waits (at most 120 s) for the test to cancel or requeue the job. MODE "resume", or a run that
Slurm restarted (SLURM_RESTART_COUNT > 0), resumes from the backup, then trains a fresh model
without interruption and reports the epochs it trained and both weight hashes.
"""

import os
import sys
import time

from backup_run import resume_or_fault

import keras

from keras_boost import callbacks, distributed

MODE, BACKUP, MARKER = sys.argv[1:4]
RESTARTED = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0


class Pause(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if MODE == "train" and not RESTARTED and epoch == 1 and distributed.rank() == 0:
            with open(MARKER, "w") as handle:
                handle.write(str(time.time()))
            time.sleep(120)  # the test cancels or requeues the job meanwhile


def main():
    resume_or_fault("resume" if RESTARTED else MODE, callbacks.BackupAndRestore(BACKUP), extra=[Pause()])


if __name__ == "__main__":
    main()
