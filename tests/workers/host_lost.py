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

import os
import sys
import time

from backup_run import resume_or_fault

import keras

from keras_boost import callbacks, distributed

MODE, BACKUP = sys.argv[1], sys.argv[2]
MARKER = os.environ.get("KB_LINK_MARKER", "")


class LoseTheLink(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if MODE == "train" and epoch == 1 and distributed.rank() == 0:
            time.sleep(8)  # the workers have run a while (their watchdogs published, beat twice) before the cut
            with open(MARKER, "w") as handle:
                handle.write(str(time.time()))
            deadline = time.monotonic() + 60
            while not os.path.exists(MARKER + ".down") and time.monotonic() < deadline:
                time.sleep(0.2)
            print(f"host_lost: the link is down at {time.time():.2f}; rank 0 goes on into epoch 2", flush=True)


def main():
    resume_or_fault(MODE, callbacks.BackupAndRestore(BACKUP), extra=[LoseTheLink()])


if __name__ == "__main__":
    main()
