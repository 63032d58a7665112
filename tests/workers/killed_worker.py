"""Rank argv[1] (default 1) is killed with SIGKILL in the middle of training (no Python cleanup at all)."""

import os
import signal
import sys
import time

from common import report

import keras

from keras_boost import distributed
from tests.helpers import classification_data, compile_sgd, mlp


KILL_RANK = int(sys.argv[1]) if len(sys.argv) > 1 else 1


class KillRankOne(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3 and distributed.rank() == KILL_RANK:
            print(f"killed_worker: rank {KILL_RANK} kills itself at {time.time():.2f}", flush=True)
            print(f"KB_FAILURE_AT {time.time()}", flush=True)  # the test times the end from here
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    distributed.init()
    x, y = classification_data(n=512)
    model = compile_sgd(mlp())
    model.fit(x, y, batch_size=8, epochs=50, verbose=0, callbacks=[KillRankOne()])
    report(distributed.rank(), finished=True)  # never reached: the run ends with the failure


if __name__ == "__main__":
    main()
