"""Rank 1 raises in the middle of training; rank 0 would wait for it in the allreduce."""

import time

from common import report

import keras

from keras_boost import BoostModel, distributed
from tests.helpers import classification_data, compile_sgd, mlp


class FailOnRankOne(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3 and distributed.rank() == 1:
            print(f"KB_FAILURE_AT {time.time()}", flush=True)  # the test times the end from here
            raise RuntimeError("injected failure on rank 1")


def main():
    distributed.init()
    x, y = classification_data(n=512)
    model = compile_sgd(mlp(BoostModel))
    model.fit(x, y, batch_size=8, epochs=20, verbose=0, callbacks=[FailOnRankOne()])
    report(distributed.rank(), finished=True)  # never reached: the run ends with the failure


if __name__ == "__main__":
    main()
