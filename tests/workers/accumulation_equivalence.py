"""Gradient accumulation on 2 workers: one collective per update, same result as 1 process.

Three phases, each against a plain-Keras single-process reference with batch 64:

1. `equivalence`: N=2 micro-batches of 16 per worker, 256 samples, 2 epochs. Each
   worker's N consecutive micro-batches and the other worker's together are exactly
   one reference batch of 64 (interleaved sharding).
2. `carry`: 3 micro-batches per worker and epoch with N=2, 2 epochs: the second window
   spans the epoch end on both workers; the reference is the workers' windows back to back.
3. `overflow`: dynamic loss scale, N=2, an inf in rank 1's second micro-batch only: the
   first window is dropped on every worker, the scale halves once, later windows train.

Per phase each rank reports the largest weight difference to the reference, a digest of
its weights, optimizer.iterations and the collectives issued by its compiled steps.
"""

import hashlib
import time

from common import report

import keras
import numpy as np

from keras_boost import BoostModel, DynamicLossScale, distributed
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights

PER_WORKER = 16
N = 2


def digest(model):
    return hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()


def interleave_shard(x, per_worker, rank, size):
    """Rank r's rows of each global batch of size*per_worker (here per_worker = N micro-batches)."""
    global_batch = per_worker * size
    batches = [x[i:i + global_batch] for i in range(0, len(x), global_batch)]
    return np.concatenate([b[rank * per_worker:(rank + 1) * per_worker] for b in batches])


def windows(stream, size=PER_WORKER * N):
    return [stream[i:i + size] for i in range(0, len(stream), size)]


def fit_counted(model, *args, **kwargs):
    before = distributed.allreduce_count()
    history = model.fit(*args, **kwargs)
    return history, distributed.allreduce_count() - before


def phase_equivalence(rank, size):
    x, y = classification_data(n=256)
    reference = compile_sgd(mlp(keras.Model, seed=0))
    reference.fit(x, y, batch_size=PER_WORKER * N * size, epochs=2, shuffle=False, verbose=0)
    # the ranks start apart; fit broadcasts rank 0's weights, the reference's initial ones
    model = compile_sgd(mlp(BoostModel, seed=0 if rank == 0 else 8), gradient_accumulation=N)
    xs, ys = (interleave_shard(a, PER_WORKER * N, rank, size) for a in (x, y))
    history, collectives = fit_counted(model, xs, ys, batch_size=PER_WORKER, epochs=2, shuffle=False, verbose=0)
    return dict(diff=max_diff(weights(reference), weights(model)), digest=digest(model),
                micro_batches=2 * len(xs) // PER_WORKER, iterations=int(model.optimizer.iterations.numpy()),
                collectives=collectives, loss=[float(v) for v in history.history["loss"]])


def phase_carry(rank, size):
    x, y = classification_data(n=PER_WORKER * 3 * size, seed=2)  # 3 micro-batches per worker and epoch
    shards = [(x[r::size], y[r::size]) for r in range(size)]
    # the reference: window k of every worker, concatenated, is its batch k
    streams = [(np.concatenate([sx, sx]), np.concatenate([sy, sy])) for sx, sy in shards]  # 2 epochs
    ref_x = np.concatenate([np.concatenate([w[k] for w in (windows(s[0]) for s in streams)]) for k in range(3)])
    ref_y = np.concatenate([np.concatenate([w[k] for w in (windows(s[1]) for s in streams)]) for k in range(3)])
    reference = compile_sgd(mlp(keras.Model, seed=0))
    reference.fit(ref_x, ref_y, batch_size=PER_WORKER * N * size, epochs=1, shuffle=False, verbose=0)
    model = compile_sgd(mlp(BoostModel, seed=0), gradient_accumulation=N)
    at_epoch_end = []
    probe = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: at_epoch_end.append(
        [int(model.optimizer.iterations.numpy()), int(model.boost_step.stage("gradient_accumulation").micro_step.numpy())]))
    _, collectives = fit_counted(model, *shards[rank], batch_size=PER_WORKER, epochs=2, shuffle=False,
                                 verbose=0, callbacks=[probe])
    return dict(diff=max_diff(weights(reference), weights(model)), digest=digest(model),
                iterations=int(model.optimizer.iterations.numpy()), collectives=collectives,
                at_epoch_end=at_epoch_end)


def phase_overflow(rank, size):
    data = [classification_data(n=PER_WORKER * N * 3, seed=5 + r) for r in range(size)]
    x, y = data[rank][0].copy(), data[rank][1]
    if rank == 1:
        x[PER_WORKER * 1, 3] = np.inf  # second micro-batch of the first window, rank 1 only
    model = compile_sgd(mlp(BoostModel, seed=0), gradient_accumulation=N,
                        loss_scale=DynamicLossScale(init_scale=1024.0))  # same weights on both ranks
    before = distributed.allreduce_count()
    scales, overflows, iterations = [], [], []
    for i in range(len(x) // PER_WORKER):
        logs = model.train_on_batch(x[PER_WORKER * i:PER_WORKER * (i + 1)], y[PER_WORKER * i:PER_WORKER * (i + 1)],
                                    return_dict=True)
        scales.append(float(logs["loss_scale"]))
        overflows.append(int(logs["overflow"]))
        iterations.append(int(model.optimizer.iterations.numpy()))
    collectives = distributed.allreduce_count() - before
    # reference: the two clean windows of both workers, as batches of 64
    ref_x = np.concatenate([np.concatenate([windows(d[0])[k] for d in data]) for k in (1, 2)])
    ref_y = np.concatenate([np.concatenate([windows(d[1])[k] for d in data]) for k in (1, 2)])
    reference = compile_sgd(mlp(keras.Model, seed=0))
    reference.fit(ref_x, ref_y, batch_size=PER_WORKER * N * size, epochs=1, shuffle=False, verbose=0)
    stage = model.boost_step.stage("gradient_accumulation")
    return dict(diff=max_diff(weights(reference), weights(model)), digest=digest(model), scales=scales,
                overflows=overflows, iterations=iterations, collectives=collectives,
                micro_step=int(stage.micro_step.numpy()),
                accumulators_finite=bool(all(np.isfinite(np.array(a)).all() for a in stage.accumulators)))


def run():
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    results, seconds = {}, {}
    for name, phase in (("equivalence", phase_equivalence), ("carry", phase_carry), ("overflow", phase_overflow)):
        start = time.monotonic()
        results[name] = phase(rank, size)
        seconds[name] = round(time.monotonic() - start, 2)
    return dict(size=size, seconds=seconds, **results)


def main():
    values = run()
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
