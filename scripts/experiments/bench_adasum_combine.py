"""Per-call cost of combining a ResNet-20-sized list of tensors across workers.

Run under a launcher, e.g.
    horovodrun -np 2 -H localhost:2 --mpi python scripts/experiments/bench_adasum_combine.py

Times, inside `tf.function`, Horovod's native Adasum (MPI, power-of-two workers only),
keras_boost's exact fallback and, for scale, a plain averaging allreduce. Rank 0 prints
one JSON line with the median and mean milliseconds per call of each (the slowest
rank's median counts).
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from keras_boost import distributed  # noqa: E402
from keras_boost.stages import adasum_ops  # noqa: E402


def resnet20_shapes(channels=1, classes=10):
    """Trainable shapes of ResNet-20 (identity shortcuts with zero padding): 269,434 values."""
    shapes = [(3, 3, channels, 16), (16,), (16,)]
    width = 16
    for stage_width in (16, 32, 64):
        for _ in range(3):
            for _ in range(2):
                shapes += [(3, 3, width, stage_width), (stage_width,), (stage_width,)]
                width = stage_width
    return shapes + [(64, classes), (classes,)]


def time_calls(fn, tensors, warmup, iters):
    for _ in range(warmup):
        fn(tensors)
    times = []
    for _ in range(iters):
        distributed.barrier()
        start = time.perf_counter()
        fn(tensors)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    distributed.init()
    rng = np.random.default_rng(distributed.rank())
    shapes = resnet20_shapes()
    tensors = [tf.constant(rng.normal(size=shape) * 1e-3, tf.float32) for shape in shapes]
    candidates = {
        "exact": lambda ts: adasum_ops.exact_adasum_allreduce(ts),
        "average": lambda ts: distributed.grouped_allreduce(ts, average=True),
    }
    if adasum_ops.resolve_backend() == adasum_ops.NATIVE:
        candidates["native"] = lambda ts: adasum_ops.native_adasum_allreduce(ts)
    summary = {
        "size": distributed.size(),
        "controller": distributed.capabilities()["controller"],
        "tensors": len(shapes),
        "parameters": int(sum(np.prod(shape) for shape in shapes)),
        "iters": args.iters,
    }
    for name, fn in candidates.items():
        times = time_calls(tf.function(fn), tensors, args.warmup, args.iters)
        medians = distributed.allgather(tf.constant([np.median(times)], tf.float64)).numpy()
        summary[f"{name}_median_ms"] = round(float(np.max(medians)), 2)
        summary[f"{name}_mean_ms"] = round(float(np.mean(times)), 2)
    if distributed.rank() == 0:
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
