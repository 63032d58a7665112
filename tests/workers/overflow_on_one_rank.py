"""A non-finite gradient on rank 1 only: every rank must skip that update and lower its scale."""

import hashlib

from common import report

import numpy as np

from keras_boost import DynamicLossScale, distributed
from tests.helpers import classification_data, compile_sgd, mlp, weights


def run():
    distributed.init()
    rank = distributed.rank()
    model = compile_sgd(mlp(), loss_scale=DynamicLossScale(init_scale=2.0**10, scale_window=3))
    x, y = classification_data(n=16 * 8, seed=5 + rank)
    x = x.copy()
    if rank == 1:
        x[16 * 2, 3] = np.inf  # third batch of rank 1 only
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)  # broadcasts rank 0's weights
    scales, overflows, iterations = [], [], []
    for step in range(1, 8):
        logs = model.train_on_batch(x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)], return_dict=True)
        scales.append(float(logs["loss_scale"]))
        overflows.append(int(logs["overflow"]))
        iterations.append(int(model.optimizer.iterations.numpy()))
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()
    return dict(scales=scales, overflows=overflows, iterations=iterations, digest=digest,
                finite=bool(all(np.isfinite(w).all() for w in weights(model))))


def main():
    values = run()
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
