"""Where a configuration's train step spends its time: op time per step by op type (TensorFlow profiler).

    .venv/bin/python scripts/experiments/profile_step.py --model resnet50 --configs keras O0 O1-nofreeze

Each configuration of `scripts/bench_apps.py` runs in its own process: built as the benchmark
builds it, one warm-up epoch of 20 steps of batch 32 under `fit`, then 8 steps profiled inside
a second `fit`. Printed: the wall time per profiled step, the op time per step summed over
TensorFlow's threads (so it can exceed the wall time on several cores), and the op types that
take the most. The profiler slows the step a little; compare configurations, not absolute times.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
import bench_common  # noqa: E402 (sys.path and log level)

STEPS = 8


def worker(family, config, top):
    import keras
    import numpy as np
    import tensorflow as tf

    import bench_apps

    model = bench_apps.build(family, config)
    rng = np.random.default_rng(0)
    x, y = bench_apps.sample_inputs(family, 32 * 40, rng), rng.integers(0, 10, 32 * 40)
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=20, verbose=0)
    logdir = tempfile.mkdtemp()
    wall = {}

    class Profile(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 3:
                tf.profiler.experimental.start(logdir)
                wall["start"] = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 + STEPS:
                tf.profiler.experimental.stop()
                wall["step"] = (time.perf_counter() - wall["start"]) / STEPS

    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=STEPS + 5, verbose=0, callbacks=[Profile()])
    ops = collections.Counter()
    for name, runs in bench_common.profiled_ops(logdir).items():
        ops[name.rsplit(":", 1)[1]] += sum(runs) / STEPS
    print("RESULT " + json.dumps({"wall": 1000 * wall["step"], "total": sum(ops.values()),
                                  "ops": ops.most_common(top)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--configs", nargs="+", default=["keras", "O0", "O1-nofreeze"])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.configs[0], args.top)
    for config in args.configs:
        out = subprocess.run([sys.executable, __file__, "--worker", "--model", args.model, "--configs", config,
                              "--top", str(args.top)], capture_output=True, text=True, timeout=1200)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            sys.exit(f"{config} failed:\n{out.stderr[-3000:]}")
        result = json.loads(lines[-1][len("RESULT "):])
        print(f"{args.model} {config}: {result['wall']:.0f} ms per profiled step, op time {result['total']:.0f} ms")
        for name, ms in result["ops"]:
            print(f"    {ms:7.1f} ms  {name}")


if __name__ == "__main__":
    main()
