"""Where the step of a small model goes: keras-io's timeseries FCN by its recipe (Adam, batch 32).

Each configuration trains 3 epochs of 10,000 Fashion-MNIST series in its own process
(`keras_boost.app.turns`: the configurations take turns, rotated per round) and reports the
median step after the first 400 (each epoch's first left out) and the median epoch after
the first:

    keras, keras-spe8   plain keras.Model, one step per call / 8 steps per call
                        (`compile(steps_per_execution=8)`: Keras' own per-call cost, shared by 8)
    keras-bf16          plain keras.Model in mixed_bfloat16
    O0, O1, O1-float32  BoostModel at the level (O1 in mixed_bfloat16 where `--precision auto`
                        picks it, and in float32)
    O1-nogc, O1-nofused, O1-nofusedbn, O1-nolessbn
                        O1 without gradient centralization, the fused update, the fused
                        BatchNorm, LessBN

    .venv/bin/python scripts/experiments/bench_short_step.py --rounds 2 --configs keras keras-spe8 O0 O1
"""

import argparse
import json
import statistics
import sys
import time

# name: (level or None for keras.Model, boost configuration, steps per call, precision)
CONFIGS = {
    "keras": (None, None, 1, "float32"),
    "keras-spe8": (None, None, 8, "float32"),
    "keras-bf16": (None, None, 1, "mixed_bfloat16"),
    "O0": ("O0", None, 1, "auto"),
    "O1": ("O1", None, 1, "auto"),
    "O1-float32": ("O1", None, 1, "float32"),
    "O1-nogc": ("O1", {"less_bn": {"gc_flag": False}}, 1, "auto"),
    "O1-nofused": ("O1", {"boost": {"fused_update": False}}, 1, "auto"),
    "O1-nofusedbn": ("O1", {"boost": {"fused_batchnorm": False}}, 1, "auto"),
    "O1-nolessbn": ("O1", {"boost": {"less_bn": False}}, 1, "auto"),
}


def worker(name):
    import keras

    import keras_boost
    from keras_boost.app.recipes import recipe
    from keras_boost.app.training import load_dataset
    from keras_boost.precision import resolve_precision

    level, config, per_call, precision = CONFIGS[name]
    keras.config.set_dtype_policy(resolve_precision(precision, level))
    model_recipe = recipe("timeseries")
    (x, y), _ = load_dataset("fashion_mnist", train_samples=10000)
    x = model_recipe.inputs(x)
    keras.utils.set_random_seed(0)
    model = model_recipe.build()
    if level is not None:
        model = keras_boost.BoostModel(model.inputs, model.outputs, boost_level=level, boost_config_dict=config)
    model.compile(optimizer=model_recipe.optimizer(model_recipe.lr), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=per_call)
    steps, epochs = [], []

    class Times(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epochs.append(time.perf_counter() - self.epoch)

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            steps.append((batch, (time.perf_counter() - self.start) / per_call))

    model.fit(x, y, batch_size=model_recipe.batch_size, epochs=3, verbose=0, callbacks=[Times()])
    steady = [t for batch, t in steps[400 // per_call:] if batch != 0]
    print("RESULT " + json.dumps({"step_ms": 1000 * statistics.median(steady), "epoch_s": statistics.median(epochs[1:]),
                                  "policy": keras.config.dtype_policy().name}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker)
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
    import bench_common  # noqa: F401
    from keras_boost.app import turns

    found = {name: [] for name in args.configs}
    for index in range(args.rounds):
        for name in turns.turn_order(args.configs, index):
            found[name].append(turns.run_once([sys.executable, __file__, "--worker", name], timeout=600, name=name))
            print(name, found[name][-1], flush=True)
    for name, runs in found.items():
        steps, epochs = [r["step_ms"] for r in runs], [r["epoch_s"] for r in runs]
        print(f"{name}: step {statistics.median(steps):.2f} ms ({min(steps):.2f}-{max(steps):.2f}), "
              f"epoch {statistics.median(epochs):.2f} s ({min(epochs):.2f}-{max(epochs):.2f})")


if __name__ == "__main__":
    main()
