"""Median step time of the demo model at O0 and O1 (and O1 without freezing or without GC).

    .venv/bin/python scripts/experiments/bench_level_steps.py --rounds 3

The configurations take turns for `--rounds` rounds of 40 steps of batch 64 in one
process; the first steps of each round (tracing) are dropped.
"""

import sys
import os
import argparse
import statistics

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
from bench_common import StepTimer

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_boost import BoostModel  # noqa: E402
from keras_boost.app.demo_net import demo_resnet  # noqa: E402

CONFIGS = {
    "O0": (None, None),
    "O1": ("O1", {"grad_freeze": {"total_steps": 200}}),
    "O1 without freezing": ("O1", {"boost": {"mode": "manual", "grad_freeze": False}}),
    "O1 without GC": ("O1", {"grad_freeze": {"total_steps": 200}, "less_bn": {"gc_flag": False}}),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    base = demo_resnet(model_class=keras.Model)
    rng = np.random.default_rng(0)
    x = rng.random((64 * 40, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    models = {}
    for name, (level, config) in CONFIGS.items():
        model = BoostModel(base.inputs, base.outputs, boost_level=level, boost_config=config)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        models[name] = model
    times = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            timer = StepTimer()
            model.fit(x, y, batch_size=64, verbose=0, callbacks=[timer])
            times[name].extend(timer.times[3:])
    base_ms = 1000 * statistics.median(times["O0"])
    print("| configuration | median step (ms) | speed-up vs O0 |")
    print("|---|---|---|")
    for name, values in times.items():
        ms = 1000 * statistics.median(values)
        print(f"| {name} | {ms:.1f} | {base_ms / ms:.2f}x |")


if __name__ == "__main__":
    main()
