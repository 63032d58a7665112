"""A two-headed model at the boost levels: a softmax classifier and a Dense(1) regression.

Dict inputs (a 16x16 image and a 4-vector), 3 conv+BatchNorm blocks, outputs
{"cls": Dense(3, softmax), "reg": Dense(1)}; 1536 synthetic training samples, 512 test,
12 epochs of Adam, batch 32. Prints each configuration's test losses and accuracy
(docs/less_bn.md, `fn_outputs`; docs/benchmarks.md, "A model with a regression output").

Usage: .venv/bin/python scripts/experiments/bench_two_headed.py [CONFIG ...]
CONFIG: keras, O0, O1, O1-forced (the less_bn section given: MindSpore's LessBN, BatchNorms
removed and an FN head on both outputs), O1-forced-noGC.
"""

import sys
import warnings

import keras
import numpy as np

from keras_boost import BoostModel

CONFIGS = {
    "keras": (keras.Model, {}, {}),
    "O0": (BoostModel, {}, {}),
    "O1": (BoostModel, {"boost_level": "O1"}, {}),
    "O1-forced": (BoostModel, {"boost_level": "O1", "boost_config": {"less_bn": {"fn_flag": True}}}, {}),
    "O1-forced-noGC": (BoostModel, {"boost_level": "O1", "boost_config": {"less_bn": {"fn_flag": True}}},
                       {"gradient_centralization": False}),
}


def data(n=2048, seed=0):
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(n, 16, 16, 1)).astype("float32")
    aux = rng.normal(size=(n, 4)).astype("float32")
    label = (image[:, :8].mean(axis=(1, 2, 3)) > image[:, 8:].mean(axis=(1, 2, 3))).astype("int32") + (aux[:, 0] > 0)
    value = aux[:, :1] * 3 + 10 * image.mean(axis=(1, 2))
    return {"image": image, "aux": aux}, {"cls": label, "reg": value}


def build(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    image, aux = keras.Input((16, 16, 1), name="image"), keras.Input((4,), name="aux")
    x = image
    for filters in (8, 16, 16):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(x), aux])
    x = keras.layers.Dense(32, activation="relu")(x)
    outputs = {"cls": keras.layers.Dense(3, activation="softmax", name="cls")(x), "reg": keras.layers.Dense(1, name="reg")(x)}
    return model_class({"image": image, "aux": aux}, outputs, **kwargs)


def run(name):
    model_class, kwargs, compile_kwargs = CONFIGS[name]
    x, y = data()
    train = {k: v[:1536] for k, v in x.items()}, {k: v[:1536] for k, v in y.items()}
    test = {k: v[1536:] for k, v in x.items()}, {k: v[1536:] for k, v in y.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(model_class, **kwargs)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                      loss_weights={"cls": 1.0, "reg": 0.3}, metrics={"cls": ["accuracy"]}, **compile_kwargs)
        model.fit(*train, batch_size=32, epochs=12, verbose=0)
        result = model.evaluate(*test, verbose=0, return_dict=True)
    report = getattr(model, "less_bn_report", None)
    print(name, {k: round(float(v), 4) for k, v in sorted(result.items())},
          report.summary() if report is not None else "", flush=True)


def main(names):
    for name in names or CONFIGS:
        run(name)


if __name__ == "__main__":
    main(sys.argv[1:])
