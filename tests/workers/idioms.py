"""Horovod users' own idioms on several workers: each ends by itself, with the result the user meant.

    idioms.py DIR   in order, on every rank:
      1. fit; rank 0 alone evaluates and saves; a barrier (Horovod's examples and docs)
      2. rank 0 evaluates while the others have moved on (sleeping): its evaluate does not wait
      3. rank 0 predicts, runs test_on_batch and a loop of its own; a broadcast; another fit on every rank
      4. rank 0 calls fit alone while the others wait in a barrier: an error on every rank at once
      5. evaluate(across_workers=True) on evaluation data of unequal size on each worker
"""

import hashlib
import time

from common import report  # noqa: E402  (puts the repository on sys.path)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_boost import BoostModel, distributed  # noqa: E402

BATCH = 16
SLEEP = 6.0  # seconds the other ranks spend elsewhere while rank 0 evaluates
EVAL_ROWS = {0: 24, 1: 40}  # unequal evaluation shards (ranks beyond 1 get 16)


def data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, np.argmax(x @ rng.normal(size=(8, 4)), axis=1).astype(np.int32)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    model = BoostModel(inputs, keras.layers.Dense(4)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def own_loss(model, x, y):
    return float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x)))


def digest(model):
    return hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.weights)).hexdigest()


def run(directory):
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    x, y = data(64 * size, seed=1)
    xs, ys = x[rank * 64:(rank + 1) * 64], y[rank * 64:(rank + 1) * 64]
    out = {}
    model = mlp(seed=rank)  # different starts: fit's broadcast aligns them
    model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0)

    # 1. rank 0 alone evaluates and saves, then a barrier
    start = time.monotonic()
    if rank == 0:
        out["evaluate"] = model.evaluate(xs, ys, batch_size=BATCH, verbose=0, return_dict=True)["loss"]
        out["own_loss"] = own_loss(model, xs, ys)
        model.save(f"{directory}/idiom_rank{rank}.keras")
    distributed.barrier()
    out["evaluate_save_barrier_seconds"] = time.monotonic() - start

    # 2. rank 0 evaluates while the others are elsewhere
    if rank == 0:
        start = time.monotonic()
        model.evaluate(xs, ys, batch_size=BATCH, verbose=0)
        out["evaluate_while_others_sleep_seconds"] = time.monotonic() - start
    else:
        time.sleep(SLEEP)
    distributed.barrier()

    # 3. rank 0 predicts, tests on batches and runs a loop of its own; a broadcast; another fit
    value = None
    if rank == 0:
        predictions = model.predict(xs[:8], verbose=0)
        for k in range(3):
            model.test_on_batch(xs[k * BATCH:(k + 1) * BATCH], ys[k * BATCH:(k + 1) * BATCH])
        total = tf.Variable(0.0)
        for k in range(3):  # a loop of plain TensorFlow on the model's outputs
            total.assign_add(tf.reduce_sum(model(xs[k * BATCH:(k + 1) * BATCH])))
        value = float(predictions.sum()) + float(total.numpy())
    out["broadcast"] = distributed.broadcast_object(value)
    model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0)
    out["digest_after_second_fit"] = digest(model)

    # 4. rank 0 calls fit alone while the others wait in a barrier
    start = time.monotonic()
    try:
        if rank == 0:
            model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0)
        else:
            distributed.barrier()
        out["mismatch"] = None
    except distributed.CollectiveMismatch as error:
        out["mismatch"] = str(error)
    out["mismatch_seconds"] = time.monotonic() - start
    out["digest_after_mismatch"] = digest(model)  # nothing trained on either side

    # 5. every worker's metrics over unequal evaluation shards
    xe, ye = data(sum(EVAL_ROWS.get(r, 16) for r in range(size)), seed=2)
    first = sum(EVAL_ROWS.get(r, 16) for r in range(rank))
    mine = slice(first, first + EVAL_ROWS.get(rank, 16))
    out["across"] = model.evaluate(xe[mine], ye[mine], batch_size=8, verbose=0, return_dict=True,
                                   across_workers=True)
    out["own"] = model.evaluate(xe[mine], ye[mine], batch_size=8, verbose=0, return_dict=True)
    out["all_rows_loss"] = own_loss(model, xe, ye)  # the same weights on every rank: the global reference
    predicted = np.argmax(np.asarray(model(xe)), axis=1)
    out["all_rows_accuracy"] = float(np.mean(predicted == ye))
    distributed.barrier()
    return out


if __name__ == "__main__":
    import sys

    report(distributed.rank(), **run(sys.argv[1]))
