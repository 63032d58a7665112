"""Cost of the gradient finiteness check (NaN guard / loss-scale overflow) on a model's gradients.

    .venv/bin/python scripts/experiments/bench_finite_check.py --rounds 20
    .venv/bin/python scripts/experiments/bench_finite_check.py --rounds 20 --model mobilenetv2

Random tensors shaped like every trainable variable of keras.applications.ResNet50 (23.6 M
trainable values in 214 tensors) or MobileNetV2 (2.2 M values in 158 tensors, most of them small) at
32x32x3; each form of the check compiled with tf.function, taking turns, median time per
check, and an empty compiled call with the same inputs (what the call itself costs). Also
checks that each form sees one +inf.
"""

import sys
import os
import argparse
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
import bench_common  # noqa: F401  (sys.path and log level)
import keras
import numpy as np
import tensorflow as tf

from keras_boost.core.contract import all_finite


def is_finite_all(grads):
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads]))


def float32_sums(grads):
    """The sums without the casts to float64."""
    return tf.math.is_finite(tf.add_n([tf.reduce_sum(g) for g in grads]))


def small_concatenated(grads, limit=65536):
    """Gradients of up to `limit` values concatenated and summed once; the larger ones each summed."""
    small = [tf.reshape(g, [-1]) for g in grads if g.shape.num_elements() <= limit]
    parts = [tf.reduce_sum(g) for g in grads if g.shape.num_elements() > limit]
    return tf.math.is_finite(tf.add_n(parts + ([tf.reduce_sum(tf.concat(small, 0))] if small else [])))


def stacked_sums(grads):
    return tf.math.is_finite(tf.reduce_sum(tf.stack([tf.reduce_sum(g) for g in grads])))


def empty_call(grads):
    """No check: what calling a compiled function with these inputs costs."""
    return tf.constant(True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model", choices=("resnet50", "mobilenetv2"), default="resnet50")
    args = parser.parse_args()
    make = keras.applications.ResNet50 if args.model == "resnet50" else keras.applications.MobileNetV2
    model = make(weights=None, input_shape=(32, 32, 3), classes=10)
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.standard_normal(v.shape).astype("float32")) for v in model.trainable_variables]
    checks = {"is_finite + all (before)": tf.function(is_finite_all),
              "keras_boost all_finite (sums)": tf.function(all_finite),
              "float32 sums, no casts": tf.function(float32_sums),
              "small ones concatenated": tf.function(small_concatenated),
              "sums stacked": tf.function(stacked_sums)}
    bad = list(grads)
    values = bad[100].numpy()
    values.flat[0] = np.inf
    bad[100] = tf.constant(values)
    tiny = list(grads)  # an inf in the smallest gradient (a bias)
    smallest = min(range(len(tiny)), key=lambda i: int(np.prod(tiny[i].shape)))
    values = tiny[smallest].numpy()
    values.flat[0] = -np.inf
    tiny[smallest] = tf.constant(values)
    for name, check in checks.items():
        assert bool(check(grads)) and not bool(check(bad)) and not bool(check(tiny)), name
    checks["empty call (no check)"] = tf.function(empty_call)
    times = {name: [] for name in checks}
    for _ in range(args.rounds):
        for name, check in checks.items():
            start = time.perf_counter()
            check(grads).numpy()
            times[name].append(time.perf_counter() - start)
    print(f"{sum(int(np.prod(g.shape)) for g in grads)} gradient values in {len(grads)} tensors, {args.rounds} rounds")
    for name, values in times.items():
        print(f"{name}: {1000 * np.median(values):.1f} ms (median)")


if __name__ == "__main__":
    main()
