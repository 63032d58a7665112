"""The optimizer's update alone: Keras' ops against TensorFlow's fused kernel, on a model's variables.

    .venv/bin/python scripts/experiments/bench_fused_update.py --model resnet50 --optimizer sgd-momentum

Builds `keras.applications` ResNet50 (or MobileNetV2, DenseNet121) at 32x32x3, makes one
random gradient per trainable variable, and times a compiled `optimizer.apply` with Keras'
own update and inside `keras_boost`'s `fused_kernels`, taking turns (`--rounds` times,
`--calls` calls each, median per call printed). Gradient centralization (the pass a boost
level adds before the update) is timed too, alone and before each update.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/, for bench_common
import bench_common  # noqa: F401,E402  (this checkout's keras_boost on sys.path, log level)

MODELS = ("resnet50", "mobilenetv2", "densenet121")
OPTIMIZERS = ("sgd-momentum", "sgd", "adam")


def main():
    import keras
    import tensorflow as tf

    from keras_boost.stages.centralization import centralize, centralizes, gc_variables
    from keras_boost.stages.fused_update import fused_kernels

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd-momentum")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--gc-forms", action="store_true",
                        help="also time the former centralization (tf.reduce_mean over the leading axes)")
    args = parser.parse_args()
    make = {"resnet50": keras.applications.ResNet50, "mobilenetv2": keras.applications.MobileNetV2,
            "densenet121": keras.applications.DenseNet121}[args.model]
    model = make(weights=None, input_shape=(32, 32, 3), classes=10)
    variables = model.trainable_variables
    grads = [tf.random.normal(v.shape, stddev=1e-6) for v in variables]
    selected = {id(v) for v in gc_variables(model) if centralizes(v.shape, 16)}
    optimizer = {"sgd-momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
                 "sgd": lambda: keras.optimizers.SGD(0.01),
                 "adam": lambda: keras.optimizers.Adam(1e-3)}[args.optimizer]()
    optimizer.build(variables)

    def centred():
        return [centralize(g) if id(v) in selected else g for g, v in zip(grads, variables)]

    def reduce_mean_form(g):  # keras_boost's centralize until December 5, 2026
        return g - tf.reduce_mean(g, axis=list(range(len(g.shape) - 1)), keepdims=True)

    def centred_reduce_mean():
        return [reduce_mean_form(g) if id(v) in selected else g for g, v in zip(grads, variables)]

    def fused_update_reduce_mean():
        with fused_kernels(optimizer):
            optimizer.apply(centred_reduce_mean(), variables)

    def keras_update(gc):
        optimizer.apply(centred() if gc else grads, variables)

    def fused_update(gc):
        with fused_kernels(optimizer):
            optimizer.apply(centred() if gc else grads, variables)

    runs = {"keras update": tf.function(lambda: keras_update(False)),
            "fused update": tf.function(lambda: fused_update(False)),
            "centralization alone": tf.function(centred),
            "centralization + keras update": tf.function(lambda: keras_update(True)),
            "centralization + fused update": tf.function(lambda: fused_update(True))}
    if args.gc_forms:
        runs["centralization alone (reduce_mean)"] = tf.function(centred_reduce_mean)
        runs["centralization (reduce_mean) + fused"] = tf.function(fused_update_reduce_mean)
    times = {name: [] for name in runs}
    for name, run in runs.items():
        run()  # trace and set up
    for _ in range(args.rounds):
        for name, run in runs.items():
            for _ in range(args.calls):
                start = time.perf_counter()
                run()
                _ = variables[0].numpy().flat[0]
                times[name].append(time.perf_counter() - start)
    size = sum(v.numpy().size for v in variables) / 1e6
    print(f"{args.model}, {size:.1f} M trainable values, {args.optimizer}, {args.rounds} rounds x {args.calls} calls "
          f"(median per call, taking turns)")
    for name, values in times.items():
        print(f"  {name:32s} {1000 * statistics.median(values):6.1f} ms  (min {1000 * min(values):.1f})")


if __name__ == "__main__":
    sys.exit(main())
