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
from keras_boost.app.demo_net import demo_resnet
from keras_boost.precision import resolve_precision

APPLICATIONS = {
    "resnet50": "ResNet50",
    "resnet101": "ResNet101",
    "resnet50v2": "ResNet50V2",
    "mobilenetv2": "MobileNetV2",
    "densenet121": "DenseNet121",
}
MODELS = ("demo", *APPLICATIONS)
DATASETS = ("fashion_mnist", "synthetic")


def load_dataset(name, train_samples=None, seed=0):
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
    return train, test


def to_rgb32(images):
    """28x28x1 images as the 32x32x3 input keras.applications models accept (zero pad, 3 channels)."""
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2), (0, 0)))
    return np.repeat(padded, 3, axis=-1)


def build_model(name, seed=0):
    """The functional model `name` (see MODELS) for 28x28 grey images, 10 classes, logits out."""
    keras.utils.set_random_seed(seed)
    if name == "demo":
        return demo_resnet(model_class=keras.Model)
    if name not in APPLICATIONS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    factory = getattr(keras.applications, APPLICATIONS[name])
    return factory(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None)


def _boost_config(args, updates):
    """The --config file (JSON only); a `grad_freeze` section it gives is sized to this run by default.

    Without one the level's own freezing keeps its defaults (its continuous sequence is the
    same pattern whatever its length): a section given would make it the user's fixed
    choice, which the level's self-measurement may not switch off.
    """
    config = read_config(args.config) if args.config else {}
    if isinstance(config.get("grad_freeze"), dict):
        config["grad_freeze"].setdefault("total_steps", max(updates, 1))
    return config


def needs_process_sets(args):
    """Whether this run's stages register Horovod process sets (AdaSum, the hierarchical allreduce)."""
    from keras_boost.config import BoostConfig

    features = BoostConfig(args.level, read_config(args.config) if args.config else None).features
    return bool(features.get("adasum") or getattr(args, "hierarchical_allreduce", False))


def prepare(args):
    """Data shards for this worker, the BoostModel at the requested level, compiled."""
    # first: pins this worker's GPU before TensorFlow touches any; Horovod's fusion and cycle time
    distributed.init(fusion_threshold_mb=getattr(args, "fusion_threshold_mb", None),
                     cycle_time_ms=getattr(args, "cycle_time_ms", None), autotune=getattr(args, "autotune", None),
                     process_sets=needs_process_sets(args) or None)
    keras.config.set_dtype_policy(resolve_precision(args.precision, args.level))
    rank, size = distributed.rank(), distributed.size()
    (x_train, y_train), (x_test, y_test) = load_dataset(args.dataset, args.train_samples, args.seed)
    if args.model != "demo":
        x_train, x_test = to_rgb32(x_train), to_rgb32(x_test)
    order = np.random.default_rng(args.seed).permutation(len(x_train))
    x_train, y_train = data.shard((x_train[order], y_train[order]), rank, size)
    x_test, y_test = data.shard((x_test, y_test), rank, size)
    steps = args.steps_per_epoch or len(x_train) // args.batch_size
    updates = args.epochs * steps // args.accumulation
    base = build_model(args.model, args.seed)
    model = BoostModel(base.inputs, base.outputs, name=base.name, boost_level=args.level,
                       boost_config=_boost_config(args, updates))
    model.compile(
        optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        loss_scale="dynamic" if args.loss_scale == "dynamic" else None,
        gradient_accumulation=args.accumulation if args.accumulation > 1 else None,
        compression=None if getattr(args, "compression", "none") == "none" else args.compression,
        hierarchical_allreduce=bool(getattr(args, "hierarchical_allreduce", False)) or None,
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
    if model.less_bn_report is not None:
        report["batchnorms_removed"] = f"{model.less_bn_report.num_removed} of " \
            f"{model.less_bn_report.num_removed + model.less_bn_report.num_kept}"
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
