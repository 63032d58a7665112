"""Gradient compression on 2 workers, against NumPy references of the wire.

The model is linear without bias (y = x @ w) and the loss is the mean of y_pred, so with
one sample per step a worker's gradient is its sample, exactly. Every rank draws every
rank's samples (seeded by rank), so each can compute the reference of the update itself:

1. `float16` / `bfloat16`: the update with SGD(1.0) equals the NumPy mean of the cast
   gradients (float16: Horovod sums in float16, then scales by 1/2, as NumPy float16
   arithmetic does; bfloat16: summed in float64 and rounded to bfloat16), not the
   float32 mean; one collective per update.
2. `loss_scale`: loss_scale="dynamic" with float16: a finite 1e6 on rank 0 and 40000 on
   rank 1, in the same element, are no overflow (the step applies: both saturate at 32736
   on the wire, whose float16 sum 65472 is finite; saturating at 65504 would overflow); an
   inf on rank 1 is one on both ranks (the update is skipped, the weights stay bit for bit).
3. `accumulation`: gradient_accumulation=2 with float16: one collective per update, at
   the window boundary, and the update is the compressed mean of the windows' means.
4. `freeze`: gradient freezing (one compiled step per group) with float16 against the same
   training uncompressed: close (float16's precision), not equal, identical on both ranks.

Each phase reports the largest difference to its reference, the weights' digest (equal on
both ranks) and the collectives of the compiled steps.
"""

import hashlib

from common import report

import keras
import ml_dtypes
import numpy as np

from keras_boost import BoostModel, GradientFreeze, distributed
from keras_boost.stages.compression import saturation_bound
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights

FEATURES = 6
BF16 = ml_dtypes.bfloat16


def mean_of_y(y_true, y_pred):
    return keras.ops.mean(y_pred, axis=-1)


def linear_model(**boost):
    x_in = keras.Input((FEATURES,))
    out = keras.layers.Dense(1, use_bias=False, kernel_initializer=keras.initializers.Constant(0.25))(x_in)
    model = BoostModel(x_in, out)
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=mean_of_y, **boost)
    return model


def sample(rank, step):
    """Rank `rank`'s sample at `step`: values that float16 and bfloat16 cannot hold exactly."""
    rng = np.random.default_rng([rank, step, 7])
    return (rng.normal(size=(1, FEATURES)) * 3.0 + 1.0 / 3.0).astype(np.float32)


def kernel(model):
    return np.array(model.trainable_weights[0]).copy()


def digest(model):
    return hashlib.sha256(kernel(model).tobytes()).hexdigest()


def wire_float16(grads, workers):
    """Horovod's Average of float16 values: saturate, cast, sum in float16, scale by 1/workers in float16."""
    bound = saturation_bound("float16", workers)
    cast = [np.where(np.isfinite(g), np.clip(g, -bound, bound), g).astype(np.float16) for g in grads]
    total = cast[0]
    for g in cast[1:]:
        total = total + g  # float16 + float16: rounded to float16 after every addition
    return (total * np.float16(1.0 / workers)).astype(np.float32)


def wire_bfloat16(grads, workers):
    """keras_boost's bfloat16 allreduce: bfloat16 values summed in float64, the mean rounded to bfloat16."""
    cast = [g.astype(BF16).astype(np.float64) for g in grads]
    return (np.sum(cast, axis=0) / workers).astype(np.float32).astype(BF16).astype(np.float32)


def step(model, x):
    return model.train_on_batch(x, np.zeros((1, 1), np.float32), return_dict=True)


def phase_dtype(dtype, rank, size):
    model = linear_model(compression=dtype)
    before_collectives = distributed.allreduce_count()
    diffs, float32_gaps = [], []
    for t in range(3):
        old = kernel(model)
        step(model, sample(rank, t))
        grads = [sample(r, t).T for r in range(size)]  # every rank's gradient of the kernel (FEATURES, 1)
        mean = wire_float16(grads, size) if dtype == "float16" else wire_bfloat16(grads, size)
        expected = old - mean  # SGD(1.0) in float32, as the optimizer computes it
        diffs.append(float(np.max(np.abs(kernel(model) - expected))))
        float32_gaps.append(float(np.max(np.abs(kernel(model) - (old - np.mean(grads, axis=0, dtype=np.float32))))))
    return dict(diff=max(diffs), float32_gap=min(float32_gaps), digest=digest(model),
                collectives=distributed.allreduce_count() - before_collectives, updates=3)


def phase_loss_scale(rank, size):
    model = linear_model(compression="float16", loss_scale="dynamic")
    bound = saturation_bound("float16", size)
    # step 1: a finite 1e6 on rank 0 and 40000 on rank 1, in the same element
    large_values = [1e6, 40000.0]
    old = kernel(model)
    x = sample(rank, 10)
    x[0, 2] = large_values[rank]
    logs = step(model, x)
    grads = []
    for r in range(size):
        g = sample(r, 10).T.copy()
        g[2, 0] = large_values[r]
        grads.append(g)
    expected = old - wire_float16(grads, size)
    large = dict(overflow=int(logs["overflow"]), diff=float(np.max(np.abs(kernel(model) - expected))),
                 changed=bool(np.any(kernel(model) != old)),
                 saturated=float(old[2, 0] - kernel(model)[2, 0]),  # both saturated: (32736 + 32736) / 2
                 bound=bound,
                 scale=float(logs["loss_scale"]))
    # step 2: an inf on rank 1 only
    old = kernel(model)
    x = sample(rank, 11)
    if rank == 1:
        x[0, 4] = np.inf
    logs = step(model, x)
    infinite = dict(overflow=int(logs["overflow"]), unchanged=bool(np.array_equal(kernel(model), old)),
                    scale=float(logs["loss_scale"]), finite=bool(np.isfinite(kernel(model)).all()))
    return dict(large=large, infinite=infinite, digest=digest(model))


def phase_accumulation(rank, size):
    model = linear_model(compression="float16", gradient_accumulation=2)
    before_collectives = distributed.allreduce_count()
    diffs = []
    for update in range(2):
        old = kernel(model)
        for micro in range(2):
            step(model, sample(rank, 20 + 2 * update + micro))
        window_means = []
        for r in range(size):
            a, b = (sample(r, 20 + 2 * update + micro).T for micro in range(2))
            window_means.append(((np.float32(0.0) + a) + b) * np.float32(0.5))  # the accumulation stage's mean
        diffs.append(float(np.max(np.abs(kernel(model) - (old - wire_float16(window_means, size))))))
    return dict(diff=max(diffs), digest=digest(model), collectives=distributed.allreduce_count() - before_collectives,
                updates=2, iterations=int(model.optimizer.iterations.numpy()))


def phase_freeze(rank, size):
    x, y = classification_data(n=96, seed=4 + rank)
    trained = []
    for compression in (None, "float16"):
        model = compile_sgd(mlp(BoostModel, seed=0), compression=compression,
                            gradient_freeze=GradientFreeze(param_groups=2, freeze_p=0.5, total_steps=6))
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        trained.append(model)
    plain, compressed = trained
    return dict(diff=max_diff(weights(plain), weights(compressed)), iterations=int(compressed.optimizer.iterations),
                moved=max_diff(weights(mlp(keras.Model, seed=0)), weights(compressed)),
                digest=hashlib.sha256(b"".join(w.tobytes() for w in weights(compressed))).hexdigest())


def run():
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    return dict(size=size,
                float16=phase_dtype("float16", rank, size),
                bfloat16=phase_dtype("bfloat16", rank, size),
                loss_scale=phase_loss_scale(rank, size),
                accumulation=phase_accumulation(rank, size),
                freeze=phase_freeze(rank, size))


def main():
    values = run()
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
