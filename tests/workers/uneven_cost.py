"""Per-step cost of ending unknown-length epochs together (a flag allreduce per batch).

Equal shards of 4096 samples, batch 32 (128 steps per epoch), 3 epochs: a tf.data
dataset of known cardinality (no flag) against the same dataset made of unknown
cardinality (flag path). Reports the mean time per step of epochs 2 and 3.
Run: horovodrun -np 2 -H localhost:2 --gloo python tests/workers/uneven_cost.py
"""

import time

from common import report

import keras
import tensorflow as tf

from keras_boost import BoostModel, distributed
from tests.helpers import classification_data, compile_sgd, mlp


class EpochTimes(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times = getattr(self, "times", []) + [time.perf_counter() - self.start]


def main():
    distributed.init()
    x, y = classification_data(n=4096, seed=distributed.rank() + 3)
    out = {}
    for mode in ("known", "unknown", "known", "unknown"):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if mode == "unknown":
            ds = ds.filter(lambda a, b: True)
        ds = ds.batch(32)
        model = compile_sgd(mlp(BoostModel))
        times = EpochTimes()
        model.fit(ds, epochs=3, verbose=0, callbacks=[times])
        out.setdefault(mode, []).append(sum(times.times[1:]) / (2 * 128) * 1000)
    report(distributed.rank(), ms_per_step={k: min(v) for k, v in out.items()})


if __name__ == "__main__":
    main()
