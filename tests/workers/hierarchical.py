"""Hierarchical allreduce on 4 workers: the mean of every rank's gradient, identical on every rank.

Usage (as a scenario): run(local_size). `local_size` None groups the workers by Horovod's
hosts (cross rank); an int groups blocks of that many consecutive ranks, which simulates
hosts on one machine (under MPI on one machine Horovod sees a single host).

Every rank draws every rank's gradients (seeded by rank), so each computes the NumPy
mean of all of them itself. Checked, for the stage with `local_size` and for the stage
with Horovod's topology (which falls back to the flat allreduce when Horovod sees one host):

- `reduce` of float32 tensors of awkward shapes (a scalar, odd lengths that need padding
  to equal shards, a cube), a float64, a float16 and a bfloat16 tensor, against the
  NumPy mean in float64. The hierarchical sums run in another order than NumPy's (inside
  the host, then across hosts, in the tensor's own dtype), so they agree up to rounding:
  a few ulps of the dtype at the scale of the summed magnitudes, not bit for bit;
- the results are bit for bit identical on every rank (a digest per rank);
- the collectives per call: 3 per dtype reduced hierarchically, 1 for the bfloat16 (flat);
- a BoostModel trained with hierarchical_allreduce against the same model trained with
  the default fused allreduce: equal up to float32 rounding, identical on every rank.
"""

import hashlib
import types

from common import report

import keras
import ml_dtypes
import numpy as np
import tensorflow as tf

from keras_boost import BoostModel, HierarchicalAllreduce, distributed
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights

SPECS = [  # shape, dtype
    ((), np.float32),
    ((7,), np.float32),
    ((5, 3), np.float32),
    ((3, 4, 2), np.float32),
    ((13,), np.float64),
    ((6,), np.float16),
    ((9,), ml_dtypes.bfloat16),
]
HIERARCHICAL_DTYPES = 3  # float32, float64, float16: 3 collectives each; bfloat16 takes the flat path (1)


def draw(rank):
    rng = np.random.default_rng([rank, 11])
    return [np.asarray(rng.normal(size=shape) * 10 + rank).astype(dtype) for shape, dtype in SPECS]


def tolerance(dtype, values):
    """What summing in another order may change in the mean of `values`, element-wise bound.

    Summing n values in `dtype` rounds n - 1 times, each by at most u = eps / 2 of a partial
    sum, itself at most sum|x|: the sum is off by at most (n - 1) u sum|x|, the mean by that
    / n plus one rounding of the division, u |mean| <= u sum|x| / n: at most u sum|x| in all.
    The bound is eps sum|x| (twice that). Bit-exact agreement with NumPy is not expected: the
    hierarchy sums inside each host first, then across hosts, in the tensor's own dtype. A
    wrong algorithm (a host mean for the global one, a lost or misplaced shard) is off by
    the size of the values, far beyond it.
    """
    eps = float(np.finfo(dtype).eps)
    return eps * float(np.max(np.sum(np.abs(np.asarray(values, np.float64)), axis=0)))


def check_reduce(stage, rank, size):
    stage.build(types.SimpleNamespace(model=None, optimizer=None, variables=[], state=None))
    mine = [tf.constant(v) for v in draw(rank)]

    @tf.function(autograph=False)
    def reduce():
        distributed.start_trace()
        return stage.reduce(mine, list(range(len(mine))))

    before = distributed.allreduce_count()
    reduced = [np.asarray(t.numpy()) for t in reduce()]
    collectives = distributed.allreduce_count() - before
    everyone = [draw(r) for r in range(size)]
    errors = []
    for index, (shape, dtype) in enumerate(SPECS):
        values = [np.asarray(everyone[r][index], np.float64) for r in range(size)]
        expected = np.mean(values, axis=0)
        got = reduced[index].astype(np.float64)
        assert reduced[index].dtype == np.dtype(dtype) and reduced[index].shape == shape, (index, reduced[index])
        errors.append(dict(dtype=np.dtype(dtype).name, shape=list(shape), error=float(np.max(np.abs(got - expected))),
                           tolerance=tolerance(dtype, values)))
    digest = hashlib.sha256(b"".join(r.tobytes() for r in reduced)).hexdigest()
    digests = distributed.allgather_object(digest, name=f"keras_boost.test.hierarchical.{id(stage)}")
    return dict(errors=errors, collectives=collectives, hierarchical=stage.plan is not None,
                per_host=None if stage.plan is None else stage.plan["per_host"],
                identical=len(set(digests)) == 1)


def check_training(stage, rank):
    x, y = classification_data(n=128, seed=3 + rank)  # each rank its own data
    plain = compile_sgd(mlp(BoostModel, seed=0))
    plain.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model = compile_sgd(mlp(BoostModel, seed=0), hierarchical_allreduce=stage)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()
    digests = distributed.allgather_object(digest, name="keras_boost.test.hierarchical.training")
    return dict(diff=max_diff(weights(plain), weights(model)), identical=len(set(digests)) == 1,
                moved=max_diff(weights(mlp(keras.Model, seed=0)), weights(model)))


def run(local_size=None):
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    explicit = check_reduce(HierarchicalAllreduce(local_size=local_size), rank, size)
    topology = check_reduce(HierarchicalAllreduce(), rank, size)
    training = check_training(HierarchicalAllreduce(local_size=local_size), rank)
    return dict(size=size, local_size=distributed.local_size(), cross_size=distributed.cross_size(),
                explicit=explicit, topology=topology, training=training)


def main():
    values = run()
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
