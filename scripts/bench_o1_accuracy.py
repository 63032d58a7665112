"""O0 against O1 test accuracy on three model families (issue 14, point 6).

Each family is trained as its usual Keras recipe would train it, with keras.Model
swapped for BoostModel(..., boost_level=level) and nothing else changed:
  demo       the demo ResNet (BatchNorms, logits head), SGD(0.05, momentum 0.9)
  convnet    keras-io mnist_convnet (no BatchNorm, Dense(10, softmax) head, Dropout), Adam(1e-3)
  mobilenet  keras.applications.MobileNetV2(alpha=0.35, weights=None, softmax head) on 32x32x3, Adam(1e-3)
  resnet50   keras.applications.ResNet50(weights=None, softmax head) on 32x32x3, Adam(1e-3)
  convmixer  keras-io's ConvMixer (examples/vision/convmixer.py) at 28x28x1, 32 filters, depth 3: its
             augmentation layers, GELU then BatchNorm (momentum 0.9 for these short fits), AdamW(3e-3, 1e-4);
             LessBN removes none of its BatchNorms
Variants: O0, O1 (keras_boost's defaults), O1-mindspore (MindSpore's defaults: GC on, interval
freezing over 10 groups), and diagnostics of MindSpore's O1: O1-fn-off (without the FN head),
O1-freeze-off, O1-gc-off; O1-cont (no GC, continuous freezing over 10 groups), O1-cont4 (over 4
groups: keras_boost's defaults), O1-cont4-gc (with GC),
O1-nocm (keras_boost's O1 without its one-pixel matrix products), O1-scale1 (the FN head's multiplier starting at MindSpore's 1.0), O1-adacos (at sqrt(2) ln(C-1));
O0-swa (O0 with stochastic weight averaging over the last quarter of the epochs, `swa=0.75`),
O0-swa-last (SWA over the last epoch alone: the last weights with SWA's BatchNorm pass).
Prints one JSON line per run: family, variant, seed, test accuracy, seconds.

    python scripts/bench_o1_accuracy.py --families convnet --variants O0 O1 --train-samples 10000 --epochs 3
"""

import argparse
import json
import time

import bench_common  # noqa: F401  (sys.path and log level)
import keras
import numpy as np

from keras_boost import MINDSPORE_DEFAULTS, BoostModel
from keras_boost.graph import less_bn
from keras_boost.app.data import load_fashion_mnist
from keras_boost.app.demo_net import demo_resnet
from keras_boost.app.recipes import mnist_convnet as convnet, to_rgb32

# The diagnostics vary MindSpore's O1, as docs/benchmarks.md records them, whatever keras_boost's defaults are.
MS = MINDSPORE_DEFAULTS
VARIANTS = {
    "O0": ("O0", None),
    "O1": ("O1", None),
    "O1-mindspore": ("O1", MS),
    "O1-fn-off": ("O1", {**MS, "less_bn": {"fn_flag": False, "gc_flag": True}}),
    "O1-freeze-off": ("O1", {**MS, "boost": {"mode": "manual", "grad_freeze": False}}),
    "O1-gc-off": ("O1", {**MS, "less_bn": {"fn_flag": True, "gc_flag": False}}),
    "O1-cont": ("O1", {"less_bn": {"gc_flag": False}, "grad_freeze": {"freeze_type": 0, "param_groups": 10}}),
    "O1-cont4": ("O1", {"less_bn": {"gc_flag": False}, "grad_freeze": {"freeze_type": 0, "param_groups": 4}}),
    "O1-cont4-gc": ("O1", {"less_bn": {"gc_flag": True}, "grad_freeze": {"freeze_type": 0, "param_groups": 4}}),
    # keras_boost's O1 with its freezing kept whatever LessBN removed (the grad_freeze section given)
    "O1-nocm": ("O1", {"boost": {"conv_matmul": False}}),  # O1 with its one-pixel convolutions left as convolutions
    "O1-freeze-kept": ("O1", {"grad_freeze": {"freeze_type": 0, "param_groups": 4}}),
    # the FN head's initial multiplier (keras_boost.graph.less_bn.FN_SCALE; default 16): MindSpore's 1.0, AdaCos'
    "O1-scale1": ("O1", MS),
    "O1-adacos": ("O1", MS),
}
SCALES = {"O1-scale1": "mindspore", "O1-adacos": "adacos"}
# compile options of a variant: O0 with stochastic weight averaging over the last quarter of the epochs
VARIANTS["O0-swa"] = ("O0", None)
VARIANTS["O0-swa-last"] = ("O0", None)
COMPILE = {"O0-swa": {"swa": 0.75},
           "O0-swa-last": {"swa": -1}}  # the last epoch alone: SWA's BatchNorm pass without an average


def mobilenet():
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)


def resnet50():
    return keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=10)


def convmixer(filters=32, depth=3, kernel_size=5, patch_size=2):
    layers = keras.layers

    def activation_block(x):
        return layers.BatchNormalization(momentum=0.9)(layers.Activation("gelu")(x))

    inputs = keras.Input((28, 28, 1))
    x = layers.RandomTranslation(0.1, 0.1)(layers.RandomFlip("horizontal")(inputs))
    x = activation_block(layers.Conv2D(filters, kernel_size=patch_size, strides=patch_size)(x))
    for _ in range(depth):
        x0 = x
        x = layers.Conv2D(filters, kernel_size=kernel_size, groups=filters, padding="same")(x)
        x = layers.Add()([activation_block(x), x0])
        x = activation_block(layers.Conv2D(filters, kernel_size=1)(x))
    outputs = layers.Dense(10, activation="softmax")(layers.GlobalAvgPool2D()(x))
    return keras.Model(inputs, outputs, name="convmixer")


FAMILIES = {
    # name: (builder, optimizer, from_logits, rgb input)
    "demo": (lambda: demo_resnet(model_class=keras.Model), lambda: keras.optimizers.SGD(0.05, momentum=0.9), True,
             False),
    "convnet": (convnet, lambda: keras.optimizers.Adam(1e-3), False, False),
    "mobilenet": (mobilenet, lambda: keras.optimizers.Adam(1e-3), False, True),
    "resnet50": (resnet50, lambda: keras.optimizers.Adam(1e-3), False, True),
    "convmixer": (convmixer, lambda: keras.optimizers.AdamW(3e-3, weight_decay=1e-4), False, False),
}


def run(family, variant, seed, args, data):
    (x, y), (xt, yt) = data
    builder, optimizer, from_logits, rgb = FAMILIES[family]
    if rgb:
        x, xt = to_rgb32(x), to_rgb32(xt)
    keras.utils.set_random_seed(seed)
    base = builder()
    level, config = VARIANTS[variant]
    less_bn.FN_SCALE = SCALES.get(variant, 16.0)
    model = BoostModel(base.inputs, base.outputs, name=base.name, boost_level=level, boost_config=config)
    model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits),
                  metrics=["accuracy"], **{k: (args.epochs - 1 if v == -1 else v)
                                           for k, v in COMPILE.get(variant, {}).items()})
    start = time.perf_counter()
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    seconds = time.perf_counter() - start
    accuracy = model.evaluate(xt, yt, batch_size=500, verbose=0, return_dict=True)["accuracy"]
    return {"family": family, "variant": variant, "seed": seed, "test_accuracy": round(float(accuracy), 4),
            "seconds": round(seconds, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["O0", "O1"])
    parser.add_argument("--train-samples", type=int, default=10000)
    parser.add_argument("--test-samples", type=int, default=5000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    x, y = load_fashion_mnist("train")
    xt, yt = load_fashion_mnist("test")
    order = np.random.default_rng(0).permutation(len(x))[:args.train_samples]
    data = ((x[order], y[order]), (xt[:args.test_samples], yt[:args.test_samples]))
    for family in args.families:
        for variant in args.variants:
            for seed in args.seeds:
                print(json.dumps(run(family, variant, seed, args, data)), flush=True)


if __name__ == "__main__":
    main()
