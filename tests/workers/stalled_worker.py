"""Rank STALL_RANK (argv[1], default 1) stops calling collectives: it sleeps 300 s in a
callback before train step 2. With KERAS_BOOST_STALL_TIMEOUT set small, the job must end
non-zero within about that time, naming the stalled rank."""

import sys
import time

from common import report  # noqa: F401

import keras

from keras_boost import BoostModel, distributed
from tests.helpers import classification_data, compile_sgd, mlp

STALL_RANK = int(sys.argv[1]) if len(sys.argv) > 1 else 1


class Sleep(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 2 and distributed.rank() == STALL_RANK:
            print(f"stalled_worker: rank {STALL_RANK} sleeps at train step 2 at {time.time():.2f}", flush=True)
            time.sleep(300)


def main():
    distributed.init()
    x, y = classification_data(n=256)
    model = compile_sgd(mlp(BoostModel))
    print(f"stalled_worker: rank {distributed.rank()} starts fit at {time.time():.1f}", flush=True)
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[Sleep()])


if __name__ == "__main__":
    main()
