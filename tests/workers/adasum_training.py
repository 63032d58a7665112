"""Training with AdaSum on N workers: loss falls, weights identical on every rank, and one
step's result equals a NumPy re-computation of local steps + the recursive AdaSum rule."""

import hashlib
import sys

from common import report

import keras
import numpy as np

from keras_boost import AdaSum, DynamicLossScale, distributed
from keras_boost.stages.adasum_ops import adasum_tree
from tests.helpers import classification_data, compile_sgd, mlp, weights


def local_step_deltas(x, y, start, size, lr, device_number):
    """Each group's delta for one plain-SGD step from `start`, computed with plain Keras."""
    groups = size // device_number
    deltas = []
    for g in range(groups):
        rows = slice(g * device_number * 16, (g + 1) * device_number * 16)  # the group's samples
        ref = mlp(keras.Model)
        ref.compile(optimizer=keras.optimizers.SGD(lr),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        ref.set_weights(start)
        ref.train_on_batch(x[rows], y[rows])
        deltas.append([s - np.array(w) for s, w in zip(start, ref.trainable_weights)])
    return deltas


def run(device_number=1, backend="auto"):
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    x, y = classification_data(n=16 * size * 20, seed=11)
    stage = AdaSum(device_number=device_number, backend=backend)
    lr = 0.05
    model = compile_sgd(mlp(), lr=lr, momentum=0.0, adasum=stage, loss_scale=DynamicLossScale(2.0**8))
    # one step on the first global batch, checked against the NumPy reference
    xb, yb = x[:16 * size], y[:16 * size]
    model.fit(xb[rank * 16:(rank + 1) * 16], yb[rank * 16:(rank + 1) * 16], batch_size=16, epochs=1, verbose=0)
    # the broadcast happened at the start of fit: recompute the start from rank 0's init
    start = [np.array(w) for w in mlp(keras.Model).trainable_weights]
    deltas = local_step_deltas(xb, yb, start, size, lr, device_number)
    expected = [s - np.array(adasum_tree([d[i] for d in deltas])) for i, s in enumerate(start)]
    step_diff = max(float(np.max(np.abs(e - w))) for e, w in zip(expected, weights(model)))
    # then train on the rest and watch the loss fall
    xs = np.concatenate([x[i + rank * 16:i + (rank + 1) * 16] for i in range(16 * size, len(x), 16 * size)])
    ys = np.concatenate([y[i + rank * 16:i + (rank + 1) * 16] for i in range(16 * size, len(y), 16 * size)])
    history = model.fit(xs, ys, batch_size=16, epochs=2, verbose=0, shuffle=False)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()
    return dict(step_diff=step_diff, losses=history.history["loss"], digest=digest,
                backend=stage.combine_backend, groups=stage.groups)


def main():
    values = run(int(sys.argv[1]) if len(sys.argv) > 1 else 1, sys.argv[2] if len(sys.argv) > 2 else "auto")
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
