"""Gradient freeze on 2 workers: a small CNN with BatchNorm, GradientFreeze with 4 groups.

Each rank starts from different weights (fit broadcasts rank 0's) and trains on its own
shard. Reports per rank: the freeze group of every step, the expected sequence, a hash of
the trainable weights, the loss before and after training and the optimizer iterations.
"""

import hashlib
import os

from common import report

import keras
import numpy as np

from keras_boost import BoostModel, GradientFreeze, distributed
from keras_boost.app.data import shard, synthetic

EPOCHS, BATCH, STEPS_PER_EPOCH = 3, 16, 6
# Two workers on the test machine's 2 cores leave no core for it ("auto" would not), but the
# groups' background tracing must pair its collectives across workers: tested here.
os.environ["KERAS_BOOST_TRACE_AHEAD"] = "1"


def small_cnn(seed):
    keras.utils.set_random_seed(seed)
    x_in = keras.Input((12, 12, 1))
    x = x_in
    for n, filters in enumerate((8, 8, 16)):
        x = keras.layers.Conv2D(filters, 3, strides=1 if n == 0 else 2, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return BoostModel(x_in, keras.layers.Dense(4)(x))


class GroupRecorder(keras.callbacks.Callback):
    """Records each step's group and checks what the step changed (fit runs one step per batch).

    For every step: the trainable variables outside the logged group and their optimizer
    slots (SGD momentum) must be bit-identical before and after it; those of the group
    must have moved.
    """

    def __init__(self):
        super().__init__()
        self.groups = []
        self.frozen_untouched = []  # per step: frozen variables and slots bit-identical
        self.trained_moved = []  # per step: every variable of the group moved
        self.frozen_counts = []  # per step: how many variables the step froze

    def _snapshot(self):
        variables = self.model.trainable_variables
        slots = self.model.optimizer.momentums  # built on trainable_variables, in that order
        return [(np.array(v), np.array(s)) for v, s in zip(variables, slots)]

    def on_train_batch_begin(self, batch, logs=None):
        self.before = self._snapshot()

    def on_train_batch_end(self, batch, logs=None):
        group = int(logs["freeze_group"])
        self.groups.append(group)
        in_group = set(self.model.boost_step.stage("gradient_freeze").group_indices[group])
        after = self._snapshot()
        frozen = [i for i in range(len(after)) if i not in in_group]
        self.frozen_counts.append(len(frozen))
        self.frozen_untouched.append(all(np.array_equal(self.before[i][0], after[i][0])
                                         and np.array_equal(self.before[i][1], after[i][1]) for i in frozen))
        self.trained_moved.append(all(not np.array_equal(self.before[i][0], after[i][0])
                                      and not np.array_equal(self.before[i][1], after[i][1]) for i in in_group))


def run():
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    collectives_before = distributed.allreduce_count()  # 0 when this is the first scenario of the process
    x, y = synthetic(BATCH * STEPS_PER_EPOCH * size, shape=(12, 12, 1), classes=4, seed=0)
    xs, ys = shard((x, y), rank, size)
    total_steps = EPOCHS * STEPS_PER_EPOCH
    freeze = GradientFreeze(param_groups=4, freeze_type=1, freeze_p=0.5, total_steps=total_steps, seed=3)
    model = small_cnn(seed=rank + 11)  # start apart: the broadcast must align them
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), gradient_freeze=freeze)
    before = model.evaluate(xs, ys, batch_size=BATCH, verbose=0, return_dict=True)["loss"]  # rank-local weights
    recorder = GroupRecorder()
    history = model.fit(xs, ys, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[recorder])
    after = model.evaluate(xs, ys, batch_size=BATCH, verbose=0, return_dict=True)["loss"]
    trainable = [np.array(w) for w in model.trainable_weights]
    return dict(groups=recorder.groups, expected=freeze.generate_freeze_index_sequence()[:total_steps].tolist(),
                digest=hashlib.sha256(b"".join(w.tobytes() for w in trainable)).hexdigest(),
                before=float(before), after=float(after), history=[float(v) for v in history.history["loss"]],
                iterations=int(model.optimizer.iterations.numpy()),
                collectives=distributed.allreduce_count() - collectives_before,
                frozen_untouched=recorder.frozen_untouched, trained_moved=recorder.trained_moved,
                frozen_counts=recorder.frozen_counts, traced_ahead=model.train_function.traced_ahead,
                set_up_ahead=model.train_function.set_up_ahead,
                finite=bool(all(np.isfinite(w).all() for w in trainable)))


def main():
    values = run()
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
