"""2 workers with batch b against 1 process (plain Keras) with batch 2b, on the same data.

Prints per rank: the largest weight difference to the reference, a hash of the weights
and the epoch logs of fit and evaluate.
"""

import hashlib
import sys

from common import report

import keras
import numpy as np

from keras_boost import BoostModel, BoostTrainOneStep, distributed
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights



def interleave_shard(x, per_worker, rank, size):
    """Rank r's rows of each global batch of size*per_worker, so the workers' batches
    together form exactly the reference's batch."""
    global_batch = per_worker * size
    batches = [x[i:i + global_batch] for i in range(0, len(x), global_batch)]
    return np.concatenate([b[rank * per_worker:(rank + 1) * per_worker] for b in batches])


def run(accumulation=1):
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    collectives_before = distributed.allreduce_count()  # 0 when this is the first scenario of the process
    x, y = classification_data(n=256)
    per_worker = 16
    reference_batch = per_worker * size * accumulation

    reference = compile_sgd(mlp(keras.Model, seed=0))
    reference.fit(x, y, batch_size=reference_batch, epochs=2, shuffle=False, verbose=0)

    model = compile_sgd(mlp(BoostModel, seed=rank + 7), gradient_accumulation=accumulation)  # start apart
    xs, ys = (interleave_shard(a, per_worker * accumulation, rank, size) for a in (x, y))
    # within one accumulation window the micro-batches of a worker are consecutive rows
    if rank == 0:  # the others start elsewhere: fit must broadcast rank 0's weights
        for variable, value in zip(model.trainable_variables, mlp(keras.Model, seed=0).get_weights()):
            variable.assign(value)
    history = model.fit(xs, ys, batch_size=per_worker, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(xs, ys, batch_size=32, verbose=0, return_dict=True, across_workers=True)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()
    return dict(diff=max_diff(weights(reference), weights(model)), digest=digest,
                history={k: [float(v) for v in vs] for k, vs in history.history.items()},
                evaluation={k: float(v) for k, v in evaluation.items()},
                collectives=distributed.allreduce_count() - collectives_before,
                iterations=int(model.optimizer.iterations.numpy()), horovod_ops=horovod_ops(x, y))


def horovod_ops(x, y):
    """{split: {Horovod op type: count}} in the compiled graph of one standalone step, and the gradient count.

    By default all gradients go in one grouped allreduce; with gradient_split_groups="each"
    every gradient is its own allreduce, handed to Horovod when the backward pass produces it.
    """
    found = {}
    for split in (None, "each"):
        model = mlp(keras.Model, seed=0)
        step = BoostTrainOneStep(model, keras.optimizers.SGD(0.1), gradient_split_groups=split,
                                 loss_fn=keras.losses.SparseCategoricalCrossentropy())
        data = (x[:16], y[:16])
        step(*data)
        counts = found[str(split)] = {}
        for op in step._compiled[None].get_concrete_function(data).graph.get_operations():
            if op.type.startswith("Horovod"):
                counts[op.type] = counts.get(op.type, 0) + 1
    return dict(ops=found, gradients=len(model.trainable_variables))


def main():
    values = run(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
