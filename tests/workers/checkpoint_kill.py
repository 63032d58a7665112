"""Rank 0 is SIGKILLed while it writes a BackupAndRestore backup; a relaunch resumes from the last whole one.

argv[1] = "crash": 2 workers train 4 epochs with a backup at every epoch end; at the end
of epoch 2 rank 0 writes half of the new weights file and kills itself before the
rename (the state of a machine that dies in the middle of the write).
argv[1] = "resume": the same script with the same backup directory (argv[2]) resumes,
and then trains a fresh model for the 4 epochs without interruption; it reports the
epochs the resumed run trained and both weight hashes.
"""

import os
import signal
import sys
import time

from backup_run import resume_or_fault

from keras_boost import callbacks, distributed

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


def main():
    resume_or_fault(MODE, DieWhileWriting(BACKUP))


if __name__ == "__main__":
    main()
