"""Step time per freeze group, from the per-step log that `scripts/bench_apps.py --raw FILE` writes.

    .venv/bin/python scripts/experiments/bench_groups.py FILE --steps 30

For every run of a configuration that freezes (O1, O2, O1-mindspore, O1-cont, ...), the
median wall-clock and CPU time of the steps that trained each group, after the first
epoch, without each epoch's first step and the steps that compiled a group (the same
steps as bench_apps' step column). The group of each step is recomputed from the
configuration's freeze sequence, so the run must be one of bench_apps' configurations
and the keras_boost defaults must be those it ran with.
"""

import sys
import os
import argparse
import json

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
import bench_common  # noqa: F401  (sys.path and log level)
from bench_apps import CONFIGS
from keras_boost.app.bench import steady_indices
from keras_boost.config import BoostConfig
from keras_boost.stages.freeze import generate_freeze_index_sequence


def sequence_of(config):
    level, boost_config = CONFIGS.get(config, ("keras", None))  # group-K / hand-K: one group throughout
    if level == "keras":
        return None
    boost = BoostConfig(level, boost_config)
    if not boost.features["grad_freeze"]:
        return None
    freeze = boost.params["grad_freeze"]
    return np.asarray(generate_freeze_index_sequence(freeze["param_groups"], freeze["freeze_type"],
                                                     freeze["freeze_p"], freeze["total_steps"], freeze["seed"]))


def per_group(run, steps_per_epoch):
    steps, cpu = np.asarray(run["steps"]), np.asarray(run["cpu_steps"])
    index = np.arange(len(steps))
    keep = np.isin(index, steady_indices(run["steps"], steps_per_epoch))
    sequence = sequence_of(run["config"])
    groups = np.zeros(len(steps), int) if sequence is None else sequence[(index + steps_per_epoch) % len(sequence)]
    return {int(g): (int((keep & (groups == g)).sum()), 1000 * float(np.median(steps[keep & (groups == g)])),
                     1000 * float(np.median(cpu[keep & (groups == g)])))
            for g in np.unique(groups[keep])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", help="the --raw file of scripts/bench_apps.py")
    parser.add_argument("--steps", type=int, required=True, help="the --steps (steps per epoch) of that run")
    args = parser.parse_args()
    for line in open(args.raw):
        run = json.loads(line)
        cells = ", ".join(f"group {g}: {n} steps, {wall:.0f} ms (CPU {cpu:.0f} ms)"
                          for g, (n, wall, cpu) in per_group(run, args.steps).items())
        print(f"round {run['round'] + 1} {run['config']}: {cells}")


if __name__ == "__main__":
    main()
