"""O1's self-measurement on 2 workers: freezing's verdict is forced "off", so it switches off mid-fit.

Each rank times its own steps; the decision is taken on the averaged numbers at the same
batch on every rank. Reports per rank: the decisions, the freeze group of every step, the
step at which the decision was taken, a hash of the trainable weights and how often each
compiled function was traced.
"""

import hashlib
import os

import keras
import numpy as np

from keras_boost import BoostModel, distributed
from keras_boost.app.data import shard, synthetic

EPOCHS, BATCH, STEPS_PER_EPOCH = 4, 16, 12


class Groups(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.groups, self.decided_at = [], None

    def on_train_batch_end(self, batch, logs=None):
        self.groups.append(int(logs["freeze_group"]))
        if self.decided_at is None and self.model.self_measurement is not None:
            self.decided_at = len(self.groups) - 1


def run(verdict="off"):
    """verdict: "off"/"on" force the timing's verdict (the gate off: its steps are not what is
    tested); "gate": the gate decides, with the fit's own numbers."""
    from keras_boost.step.tuning import SelfMeasurement

    SelfMeasurement.gate = verdict == "gate"
    distributed.init()
    if verdict == "gate":  # rank 1 compiles its groups when they first train, rank 0 ahead: the gate holds both
        os.environ["KERAS_BOOST_TRACE_AHEAD"] = "0" if distributed.rank() == 1 else "1"
    rank, size = distributed.rank(), distributed.size()
    x, y = synthetic(BATCH * STEPS_PER_EPOCH * size, shape=(12, 12, 1), classes=4, seed=0)
    xs, ys = shard((x, y), rank, size)
    keras.utils.set_random_seed(rank + 5)  # start apart: the broadcast must align them
    inputs = keras.Input((12, 12, 1))
    h = inputs
    for filters in (8, 16, 16):  # LessBN removes one BatchNorm: freezing and GC are the level's, both timed
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling2D()(h))
    model = BoostModel(inputs, outputs, boost_level="O1")
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # no schedule saves 200%: off; any schedule saves more than -1000%: on
    if verdict != "gate":
        model.boost_step.stage("gradient_freeze").min_saving = 2.0 if verdict == "off" else -10.0
    groups = Groups()
    model.fit(xs, ys, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[groups])
    trainable = [np.array(w) for w in model.trainable_weights]
    return dict(decisions=[[option, kept] for option, kept, _ in model.self_measurement],
                groups=groups.groups, decided_at=groups.decided_at,
                position=int(model.boost_step.stage("gradient_freeze").position.numpy()),
                centralization_on=model.boost_step.stage("gradient_centralization").is_on(),
                tracing=sorted(f"{k}{g}:{n}" for (k, g), n in model.train_function.tracing_counts().items()),
                digest=hashlib.sha256(b"".join(w.tobytes() for w in trainable)).hexdigest(),
                finite=bool(all(np.isfinite(w).all() for w in trainable)))
