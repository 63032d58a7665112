"""What runs in a configuration's train step that another's does not: op counts of the traced graphs.

    .venv/bin/python scripts/bench_step_ops.py --model resnet50 --configs keras O0 O0-noguard freeze-p1 group-5 hand-5

Each configuration of `bench_apps.py` is built, trained for one step with `fit`, and the graph
of its compiled train function (with every function it calls) is counted op type by op
type. Printed: the total, then the ops each configuration adds or removes against the one
before it. Deterministic (no timing), so it explains a time difference without noise.
"""

import argparse
import sys

import bench_common  # noqa: F401  (sys.path and log level)
import numpy as np
import tensorflow as tf

import bench_apps
from keras_boost.app.step_ops import op_counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=bench_apps.FAMILIES, default="resnet50")
    parser.add_argument("--configs", nargs="+", type=bench_apps.config_name, default=["keras", "O0", "freeze-p1"])
    args = parser.parse_args()
    x = np.zeros_like(bench_apps.sample_inputs(args.model, 32, np.random.default_rng(0)))
    y = np.zeros((32,), np.int64)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    counts = {}
    for config in args.configs:
        model = bench_apps.build(args.model, config)
        model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)
        counts[config] = op_counts(model)
        print(f"{config}: {sum(counts[config].values())} ops", flush=True)
    for before, after in zip(args.configs, args.configs[1:]):
        a, b = counts[before], counts[after]
        diff = {op: b[op] - a[op] for op in set(a) | set(b) if a[op] != b[op]}
        ordered = sorted(diff.items(), key=lambda item: (-abs(item[1]), item[0]))
        print(f"{before} -> {after}: " + (", ".join(f"{op} {n:+d}" for op, n in ordered) or "the same ops"))


if __name__ == "__main__":
    sys.exit(main())
