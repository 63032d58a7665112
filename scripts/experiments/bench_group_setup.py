"""O1's freeze groups in the first epoch: trace, first call, and what preparing them ahead saves.

    .venv/bin/python scripts/experiments/bench_group_setup.py --model mobilenetv2 --split
    KERAS_BOOST_TRACE_AHEAD=1 .venv/bin/python scripts/experiments/bench_group_setup.py --model mobilenetv2
    KERAS_BOOST_TRACE_AHEAD=0 .venv/bin/python scripts/experiments/bench_group_setup.py --model mobilenetv2

Without `--split`: one epoch of O1 (`scripts/bench_apps.py`'s model and data, 30 steps),
printing the epoch time, every step's time and which groups the background thread traced and
set up. With `--split`: after two full steps (trace-ahead off), each group's step is traced
(`get_concrete_function`), run once on an empty iterator, then on data twice, each timed: the
trace, the set-up and the first real call, one process, single runs.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
import bench_common  # noqa: F401,E402  (sys.path and log level)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mobilenetv2")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--split", action="store_true", help="time trace, empty run and first call per group")
    args = parser.parse_args()
    import keras
    import numpy as np
    import tensorflow as tf

    from bench_apps import build, sample_inputs

    if args.split:
        os.environ["KERAS_BOOST_TRACE_AHEAD"] = "0"
    model = build(args.model, "O1-fixed" if args.split else "O1")
    rng = np.random.default_rng(0)
    x = sample_inputs(args.model, 30 * args.batch_size, rng)
    y = rng.integers(0, 10, len(x))
    if not args.split:
        times = []

        class Steps(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                self.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                times.append(round(time.perf_counter() - self.start, 2))

        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False, callbacks=[Steps()])
        function = model.train_function
        print(f"first epoch {time.perf_counter() - start:.2f} s; traced ahead {function.traced_ahead}, "
              f"set up ahead {function.set_up_ahead}")
        print("steps", times)
        return
    model.fit(x, y, batch_size=args.batch_size, epochs=1, steps_per_epoch=2, verbose=0)
    function, freeze = model.train_function, model.boost_step.stage("gradient_freeze")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size)
    real = iter(ds)
    empty = iter(ds.take(0))
    steps = tf.TensorSpec([], tf.int32)
    for group in sorted(set(freeze.plan.schedule) - {0}):
        run = function._steps_on_iterator(group)
        start = time.perf_counter()
        run.get_concrete_function(real._type_spec, steps)
        traced = time.perf_counter() - start
        start = time.perf_counter()
        run(empty, tf.constant(1, tf.int32))
        set_up = time.perf_counter() - start
        position = list(freeze.plan.schedule).index(group)
        times = []
        for _ in range(2):
            freeze.position.assign(position)  # the step checks that the sequence names its group
            start = time.perf_counter()
            run(real, tf.constant(1, tf.int32))
            times.append(time.perf_counter() - start)
        print(f"group {group}: trace {traced:.2f} s, empty run (set-up) {set_up:.2f} s, "
              f"first real call {times[0]:.2f} s, second {times[1]:.3f} s", flush=True)


if __name__ == "__main__":
    main()
