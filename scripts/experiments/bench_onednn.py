"""ResNet50's gradient with TensorFlow's default CPU kernels against oneDNN, and where the time goes.

    .venv/bin/python scripts/experiments/bench_onednn.py

No keras_boost: a `tf.GradientTape` step of `keras.applications.ResNet50(weights=None,
input_shape=(32, 32, 3), classes=10)` on batch 32, compiled with `tf.function`. Each setting
of `TF_ENABLE_ONEDNN_OPTS` (unset, "1") runs in its own process, because TensorFlow reads
it when it loads. Prints the forward (training mode) and gradient times (mean of 3 after
one warm-up call) and the slowest op types of one profiled gradient call.
"""

import argparse
import collections
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
import bench_common  # noqa: E402 (first: this checkout's keras_boost on sys.path, not the installed one)
from keras_boost.app import turns


def worker(top):
    import keras
    import numpy as np
    import tensorflow as tf

    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((32, 32, 32, 3), dtype=np.float32))
    y = tf.constant(rng.integers(0, 10, 32))
    loss = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def forward(x):
        return model(x, training=True)

    @tf.function
    def gradient(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        return tape.gradient(value, model.trainable_variables)

    times = {}
    for name, call in (("forward", lambda: forward(x)), ("gradient", lambda: gradient(x, y))):
        call()
        start = time.perf_counter()
        for _ in range(3):
            tf.nest.map_structure(lambda t: t.numpy(), call())
        times[name] = (time.perf_counter() - start) / 3
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        gradient(x, y)[0].numpy()
        tf.profiler.experimental.stop()
        runs = bench_common.profiled_ops(logdir)
    ops, slowest = collections.Counter(), collections.Counter()
    for name, durations in runs.items():
        ops[name.rsplit(":", 1)[1]] += sum(durations)
        slowest[name] = max(durations)
    print("RESULT " + json.dumps({"times": times, "ops": ops.most_common(top), "slowest": slowest.most_common(top)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=6, help="op types and single ops to list")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.top)
    for setting in (None, "1"):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("TF_ENABLE_ONEDNN_OPTS", None)
        if setting:
            env["TF_ENABLE_ONEDNN_OPTS"] = setting
        result = turns.run_once([sys.executable, __file__, "--worker", "--top", str(args.top)], timeout=900,
                                env=env, name=f"TF_ENABLE_ONEDNN_OPTS={setting or 'unset'}")
        print(f"TF_ENABLE_ONEDNN_OPTS={setting or 'unset'}: forward {1000 * result['times']['forward']:.0f} ms, "
              f"gradient {1000 * result['times']['gradient']:.0f} ms")
        for name, ms in result["ops"]:
            print(f"    {ms:8.1f} ms  {name} (all of this type)")
        for name, ms in result["slowest"]:
            print(f"    {ms:8.1f} ms  {name}")


if __name__ == "__main__":
    main()
