"""The training recipe behind `keras-boost train`: data, model, boost options, fit, evaluate."""

import time

import keras
import numpy as np

from keras_boost import data, distributed
from keras_boost.models import demo_resnet


def load_dataset(name, train_samples=None, seed=0):
    """(x_train, y_train), (x_test, y_test) for `name` in {"fashion_mnist", "synthetic"}."""
    if name == "fashion_mnist":
        train, test = data.load_fashion_mnist("train"), data.load_fashion_mnist("test")
    elif name == "synthetic":
        x, y = data.synthetic((train_samples or 2048) + 512, seed=seed)
        train, test = (x[512:], y[512:]), (x[:512], y[:512])
    else:
        raise ValueError(f"dataset must be 'fashion_mnist' or 'synthetic', got {name!r}")
    if train_samples:
        train = tuple(a[:train_samples] for a in train)
    return train, test


def run_training(args):
    """Trains per `args` (the `keras-boost train` options) on this worker; returns a summary dict."""
    distributed.init()
    keras.utils.set_random_seed(args.seed)
    keras.config.set_dtype_policy(args.precision)
    rank, size = distributed.rank(), distributed.size()
    (x_train, y_train), (x_test, y_test) = load_dataset(args.dataset, args.train_samples, args.seed)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(x_train))
    x_train, y_train = data.shard((x_train[order], y_train[order]), rank, size)
    x_test, y_test = data.shard((x_test, y_test), rank, size)

    model = demo_resnet()
    model.compile(
        optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        loss_scale="dynamic" if args.loss_scale == "dynamic" else None,
        gradient_accumulation=args.accumulation,
    )
    start = time.perf_counter()
    history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                        steps_per_epoch=args.steps_per_epoch, shuffle=True)
    wall = time.perf_counter() - start
    test = model.evaluate(x_test, y_test, batch_size=256, return_dict=True)
    return {
        "workers": size,
        "epochs": args.epochs,
        "train_loss": round(float(history.history["loss"][-1]), 4),
        "test_accuracy": round(float(test["accuracy"]), 4),
        "wall_time_s": round(wall, 1),
    }
