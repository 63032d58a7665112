"""keras-io's ConvMixer at O0 and at O1 with its freezing kept: does freezing alone cost accuracy?

keras-io's examples/vision/convmixer.py (32 filters, depth 3, its augmentation layers, GELU then
BatchNorm, AdamW 3e-3 with weight decay 1e-4) on Fashion-MNIST from the Debian package, as its
recipe trains: the first 3000 training images, 300 of them held out for validation, batch 64,
ModelCheckpoint(save_best_only on val_accuracy, weights), and the best weights evaluated on the
10000 test images. BatchNorm momentum 0.9 (keras' 0.99 leaves the moving statistics unsettled
after 4 short epochs: every level scored about 10%). No LessBN rule removes ConvMixer's
BatchNorms (they follow a GELU), so O1 with `{"grad_freeze": ...}` given (freezing kept whatever
LessBN removed) is freezing alone; keras_boost's O1 switches it off there
(docs/auto_boost.md, docs/benchmarks.md "Freezing alone on keras-io's ConvMixer").

Usage: .venv/bin/python scripts/experiments/convmixer_freeze_accuracy.py --seeds 0 1 2 [--epochs 4]
Prints one JSON line per run (configuration, seed, test accuracy, seconds), each in its own process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CONFIGS = {"O0": {}, "O1": {"boost_level": "O1"},
           "O1-freeze-kept": {"boost_level": "O1",
                              "boost_config": {"grad_freeze": {"freeze_type": 0, "param_groups": 4}}}}


def worker(config, seed, epochs):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
    import bench_common  # noqa: F401  (sys.path and log level)
    import keras

    from bench_o1_accuracy import convmixer
    from keras_boost import BoostModel
    from keras_boost.app.data import load_fashion_mnist

    x, y = load_fashion_mnist("train")
    xt, yt = load_fashion_mnist("test")
    x, y = x[:3000], y[:3000]
    (xv, yv), (x, y) = (x[:300], y[:300]), (x[300:], y[300:])
    keras.utils.set_random_seed(seed)
    base = convmixer()
    model = BoostModel(base.inputs, base.outputs, name="convmixer", **CONFIGS[config])
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=0.003, weight_decay=0.0001),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    best = os.path.join(tempfile.mkdtemp(), "best.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(best, monitor="val_accuracy", save_best_only=True,
                                                 save_weights_only=True)
    start = time.perf_counter()
    model.fit(x, y, validation_data=(xv, yv), epochs=epochs, batch_size=64, callbacks=[checkpoint], verbose=0)
    seconds = time.perf_counter() - start
    model.load_weights(best)
    accuracy = model.evaluate(xt, yt, batch_size=500, verbose=0, return_dict=True)["accuracy"]
    print("RESULT " + json.dumps({"config": config, "seed": seed, "test_accuracy": round(float(accuracy), 4),
                                  "seconds": round(seconds, 1)}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["O0", "O1-freeze-kept"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.epochs)
        return
    for seed in args.seeds:
        for config in args.configs:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", config, str(seed),
                                  "--epochs", str(args.epochs)], capture_output=True, text=True, timeout=1800)
            lines = [line[7:] for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            print(lines[0] if lines else json.dumps({"config": config, "seed": seed, "error": out.stderr[-500:]}),
                  flush=True)


if __name__ == "__main__":
    main()
