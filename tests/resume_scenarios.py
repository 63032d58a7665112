"""Interrupted-and-resumed runs against uninterrupted ones, with every boost stage on.

Shared by the single-process tests and the 2-worker worker script.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_boost import DynamicLossScale, FreezeOpt, distributed
from keras_boost.callbacks import BackupAndRestore
from tests.helpers import classification_data, mlp, weights

EPOCHS = 4


def boosted_model():
    """Freezing (explicit schedule), accumulation 2, dynamic loss scaling, the weights' EMA and SWA from epoch 1, all on."""
    model = mlp()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    groups = [list(model.trainable_variables), list(model.trainable_variables[2:])]
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  loss_scale=DynamicLossScale(init_scale=2.0**6, scale_window=3), gradient_accumulation=2,
                  gradient_freeze=FreezeOpt(optimizer, groups, [0, 1, 1, 0, 1]), ema=0.9, swa=1)
    return model


def shard_data(n=16 * 12):
    x, y = classification_data(n=n * distributed.size(), seed=4)
    x = x.copy()
    x[16 * 6 * distributed.size(), 1] = np.inf  # rank 0's 7th micro-batch, in a window training group 0
    rank = distributed.rank()
    return x[rank::distributed.size()], y[rank::distributed.size()]


def checkpoint_mid_window(directory, stop_after=5):
    """train_on_batch loop; tf.train.Checkpoint after `stop_after` micro-batches (mid-window)."""
    x, y = shard_data()
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]
    reference = boosted_model()
    for xb, yb in batches:
        reference.train_on_batch(xb, yb)
    first = boosted_model()
    for xb, yb in batches[:stop_after]:
        first.train_on_batch(xb, yb)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(f"{directory}/ckpt")
    resumed = boosted_model()
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(path).assert_existing_objects_matched()
    for xb, yb in batches[stop_after:]:
        resumed.train_on_batch(xb, yb)
    return reference, resumed


class _Crash(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("simulated crash")


def backup_and_restore(directory, crash_epoch=2):
    """fit with BackupAndRestore, crashed at the start of `crash_epoch`, then fit again."""
    x, y = shard_data()
    reference = boosted_model()
    reference.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, shuffle=False)
    crashed = boosted_model()
    try:
        crashed.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, shuffle=False,
                    callbacks=[BackupAndRestore(directory), _Crash(crash_epoch)])
    except RuntimeError as error:
        assert "simulated crash" in str(error)
    resumed = boosted_model()
    history = resumed.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, shuffle=False,
                          callbacks=[BackupAndRestore(directory)])
    assert len(history.history["loss"]) == EPOCHS - crash_epoch  # it resumed, it did not start over
    return reference, resumed


def boost_state(model):
    """Every boost variable by name (its path), and what every feature reports of its state
    (`boost_step.logs()`: the loss scale, the overflow flag, the freezing group...), by key.

    By name with equal key sets, not `zip`: a variable that one model lacks is a difference,
    and a feature that keeps its state outside the boost state (so the backup misses it and
    both models lack it) still shows in what the feature reports."""
    variables = {v.path: keras.ops.convert_to_numpy(v) for v in model.boost_state.variables}
    assert len(variables) == len(model.boost_state.variables), "two boost variables share a name"
    reported = {f"logs/{key}": keras.ops.convert_to_numpy(value) for key, value in model.boost_step.logs().items()}
    return {**variables, **reported}


def identical(a, b):
    state_a, state_b = boost_state(a), boost_state(b)
    assert sorted(state_a) == sorted(state_b), (sorted(state_a), sorted(state_b))
    differing = [name for name in state_a if not np.array_equal(state_a[name], state_b[name])]
    assert not differing, {name: (state_a[name], state_b[name]) for name in differing}
    assert len(weights(a)) == len(weights(b))
    return all(np.array_equal(u, v) for u, v in zip(weights(a), weights(b)))
