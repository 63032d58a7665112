"""Worker: AdaSum across ranks, native vs exact fallback vs a NumPy reference.

Usage: adasum_combine.py SEED. Every rank draws its tensors from `SEED` and its rank,
combines them with each available backend and compares them with a NumPy reference
of the recursive rule computed locally from every rank's draws.
"""

import hashlib
import sys

import numpy as np
import tensorflow as tf

from common import report

from keras_boost import distributed
from keras_boost.stages import adasum_ops
SPECS = [  # name, shape, dtype
    ("scalar", (1,), np.float32),
    ("scalar_2d", (1, 1), np.float32),
    ("matrix", (7, 5), np.float32),
    ("odd_vector", (13,), np.float32),
    ("zero_on_rank0", (6,), np.float32),
    ("float64", (4, 3), np.float64),
    ("cube", (3, 4, 2), np.float32),
]


def draw(seed, rank):
    """The tensors of `rank`: normal draws, plus a shared direction so dots are not ~0."""
    rng = np.random.default_rng([seed, rank])
    shared = np.random.default_rng([seed, 10**6])
    values = []
    for name, shape, dtype in SPECS:
        value = rng.normal(size=shape) + shared.normal(size=shape)
        if name == "zero_on_rank0" and rank == 0:
            value = np.zeros(shape)
        values.append(value.astype(dtype))
    return values


def ref_pair(a, b):
    dot, anorm, bnorm = np.dot(a, b), np.dot(a, a), np.dot(b, b)
    acoeff = 1.0 - dot / anorm / 2 if anorm > 0 else 1.0
    bcoeff = 1.0 - dot / bnorm / 2 if bnorm > 0 else 1.0
    return acoeff * a + bcoeff * b


def ref_tree(rows, scalar_mean=True):
    """The recursive rule in float64: split at ceil(n / 2); single elements averaged."""
    if scalar_mean and rows[0].size == 1:
        return np.mean(rows, axis=0)
    if len(rows) == 1:
        return rows[0]
    half = (len(rows) + 1) // 2
    return ref_pair(ref_tree(rows[:half], False), ref_tree(rows[half:], False))


def reference(seed, size, scalar_mean=True):
    per_rank = [draw(seed, rank) for rank in range(size)]
    return [ref_tree([np.ravel(values[i]).astype(np.float64) for values in per_rank], scalar_mean)
            for i in range(len(SPECS))]


def max_diff(results, expected):
    return max(float(np.max(np.abs(np.ravel(r).astype(np.float64) - e))) for r, e in zip(results, expected))


def digest(results):
    return hashlib.sha256(b"".join(np.ascontiguousarray(r).tobytes() for r in results)).hexdigest()


def run(seed):
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    tensors = [tf.constant(value) for value in draw(seed, rank)]
    expected = reference(seed, size)

    exact = [t.numpy() for t in tf.function(adasum_ops.exact_adasum_allreduce)(tensors)]
    exact_eager = [t.numpy() for t in adasum_ops.exact_adasum_allreduce(tensors)]
    values = {
        "size": size,
        "controller": distributed.capabilities()["controller"],
        "auto_backend": adasum_ops.resolve_backend(),
        "diff_exact": max_diff(exact, expected),
        "exact_hash": digest(exact),
        "eager_equals_graph": digest(exact_eager) == digest(exact),
        "dtypes_kept": all(r.dtype == s[2] and r.shape == s[1] for r, s in zip(exact, SPECS)),
    }
    if adasum_ops.resolve_backend() == adasum_ops.NATIVE:
        combine = tf.function(lambda ts: adasum_ops.combine(ts, backend=adasum_ops.NATIVE))
        native = [t.numpy() for t in combine(tensors)]
        raw = [t.numpy() for t in tf.function(adasum_ops.native_adasum_allreduce)(tensors)]
        values.update(
            diff_native=max_diff(native, expected),
            diff_raw_native=max_diff(raw, reference(seed, size, scalar_mean=False)),
            diff_native_exact=max_diff(native, [np.ravel(e).astype(np.float64) for e in exact]),
            bitwise_equal_fraction=float(np.mean(np.concatenate(
                [np.ravel(n) == np.ravel(e) for n, e in zip(native, exact)]))),
            native_hash=digest(native),
        )
    return values


def main():
    # One write per result line: mpirun interleaves a line written in two pieces.
    sys.stdout.reconfigure(write_through=False, line_buffering=True)
    values = run(int(sys.argv[1]))
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
