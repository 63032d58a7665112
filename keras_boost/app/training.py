"""The recipes behind `keras-boost train` and `keras-boost bench`: data, model, level, fit."""

import os
import socket
import time

import keras
import numpy as np

from keras_boost import distributed
from keras_boost.app import data
from keras_boost.config import read_config
from keras_boost.fit import callbacks as boost_callbacks
from keras_boost.fit.callbacks import rank_zero_only
from keras_boost.model import BoostModel
from keras_boost.app.recipes import MODELS, recipe, to_rgb32  # noqa: F401  (to_rgb32: the scripts' import)
from keras_boost.precision import resolve_precision
from keras_boost.step import registry

DATASETS = ("fashion_mnist", "synthetic")


def load_dataset(name, train_samples=None, seed=0, test_samples=None):
    """(x_train, y_train), (x_test, y_test) for `name` in {"fashion_mnist", "synthetic"}."""
    if name == "fashion_mnist":
        train, test = data.load_fashion_mnist("train"), data.load_fashion_mnist("test")
    elif name == "synthetic":
        x, y = data.synthetic((train_samples or 2048) + 512, seed=seed)
        train, test = (x[512:], y[512:]), (x[:512], y[:512])
    else:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    if train_samples:
        train = tuple(a[:train_samples] for a in train)
    if test_samples:
        test = tuple(a[:test_samples] for a in test)
    return train, test


def build_model(name, seed=0):
    """The functional model `name` (see `keras_boost.app.recipes.MODELS`), seeded, untrained."""
    keras.utils.set_random_seed(seed)
    return recipe(name).build()


def _boost_config(args, batches):
    """The --config file (JSON only), each stage's section sized to this run's updates."""
    config = read_config(args.config) if args.config else {}
    options = cli_options(args)
    per_update = 1
    for cls in registry.stage_classes():
        per_update *= cls.batches_per_update(options[cls.option]) if cls.option in options else 1
    for cls in registry.stage_classes():
        cls.size_level_config(config, batches // per_update)
    return config


def cli_options(args):
    """The compile options the flags of `keras-boost train` ask for (each stage reads its own)."""
    options = {cls.option: cls.option_from_cli(args) for cls in registry.stage_classes()}
    return {option: value for option, value in options.items() if value is not None}


def needs_process_sets(args):
    """Whether this run's stages, the level's or the flags', may register Horovod process sets."""
    from keras_boost.config import BoostConfig

    level = registry.level_options(BoostConfig(args.level, read_config(args.config) if args.config else None))
    options = {**level, **cli_options(args)}
    return any(cls.uses_process_sets for cls in registry.stage_classes() if options.get(cls.option) is not None)


def prepare(args):
    """Data shards for this worker, the BoostModel at the requested level, compiled."""
    # first: pins this worker's GPU before TensorFlow touches any; Horovod's fusion and cycle time
    distributed.init(fusion_threshold_mb=getattr(args, "fusion_threshold_mb", None),
                     cycle_time_ms=getattr(args, "cycle_time_ms", None), autotune=getattr(args, "autotune", None),
                     process_sets=needs_process_sets(args) or None)
    keras.config.set_dtype_policy(resolve_precision(args.precision, args.level))
    rank, size = distributed.rank(), distributed.size()
    (x_train, y_train), (x_test, y_test) = load_dataset(args.dataset, args.train_samples, args.seed,
                                                             getattr(args, "test_samples", None))
    model_recipe = recipe(args.model)
    x_train, x_test = model_recipe.inputs(x_train), model_recipe.inputs(x_test)
    order = np.random.default_rng(args.seed).permutation(len(x_train))
    x_train, y_train = data.shard((x_train[order], y_train[order]), rank, size)
    x_test, y_test = data.shard((x_test, y_test), rank, size)
    steps = args.steps_per_epoch or len(x_train) // args.batch_size
    base = build_model(args.model, args.seed)
    model = BoostModel(base.inputs, base.outputs, name=base.name, boost_level=args.level,
                       boost_config=_boost_config(args, args.epochs * steps))
    model.compile(
        optimizer=model_recipe.optimizer(args.lr or model_recipe.lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=model_recipe.from_logits),
        metrics=["accuracy"],
        **cli_options(args),
    )
    return model, (x_train, y_train), (x_test, y_test)


def report_callbacks(model):
    """The callbacks that count, in a `fit`, what each stage reports (`Stage.report_callbacks`)."""
    return [c for stage in model.boost_step.stages for c in stage.report_callbacks()]


def boost_report(model):
    """What the boost did: the level, the precision, BatchNorms removed, what the level's
    self-measurement decided, and each stage's own lines (`Stage.report`: after a fit with
    `report_callbacks(model)`, what it counted)."""
    step = model.boost_step
    report = {"level": model.auto_boost.level if model.auto_boost else "O0",
              "precision": keras.config.dtype_policy().name}
    for rewrite in registry.rewrites():
        report.update(rewrite.report(model))
    for option, kept, _ in getattr(model, "self_measurement", None) or ():
        report.setdefault("self_measurement", {})[option] = "kept" if kept else "switched off"
    for stage in step.stages:
        report.update(stage.report(step))
    return report


def _checkpoint_callbacks(model, directory):
    if not directory:
        return []
    path = os.path.join(directory, "model.weights.h5")
    if os.path.exists(path):
        model.load_weights(path)  # every worker resumes from the same file
    os.makedirs(directory, exist_ok=True)
    return [rank_zero_only(keras.callbacks.ModelCheckpoint(path, save_weights_only=True))]


class _EpochsRun(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def run_training(args):
    """Trains per `args` (the `keras-boost train` options) on this worker; returns a summary dict."""
    model, (x_train, y_train), (x_test, y_test) = prepare(args)
    epochs_run = _EpochsRun()
    backup = [boost_callbacks.BackupAndRestore(args.backup_dir)] if getattr(args, "backup_dir", None) else []
    callbacks = backup + _checkpoint_callbacks(model, args.checkpoint_dir) + report_callbacks(model) + [epochs_run]
    start = time.perf_counter()
    history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                        steps_per_epoch=args.steps_per_epoch, shuffle=True, callbacks=callbacks)
    wall = time.perf_counter() - start
    test = model.evaluate(x_test, y_test, batch_size=256, return_dict=True)
    hosts = distributed.allgather_object(socket.gethostname(), name="keras_boost.worker_hosts")
    return {
        "model": args.model,
        "workers": distributed.size(),
        "hosts": hosts,  # each worker's hostname, in rank order
        "epochs": args.epochs,
        "epochs_run": epochs_run.epochs,  # after a resume from --backup-dir, the epochs left
        "train_loss": round(float(history.history["loss"][-1]), 4),
        "test_accuracy": round(float(test["accuracy"]), 4),
        "wall_time_s": round(wall, 1),
        **boost_report(model),
    }
