"""Keras 3 callbacks for Horovod training (horovod.keras' callbacks are broken under Keras 3)."""

import json
import os

import keras
import numpy as np
import tensorflow as tf

from keras_boost import _keras_compat, distributed
from keras_boost._validation import check_bool, check_int, check_real


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Sets every model and optimizer variable to rank `root_rank`'s value when training starts.

    `BoostModel.fit` adds it by itself under a launcher; add it yourself for a plain
    `keras.Model` trained with your own Horovod step.

    Args:
        root_rank: the rank whose values everyone takes, default 0.

    Example:
        >>> model.fit(x, y, callbacks=[keras_boost.callbacks.BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = check_int("root_rank", root_rank, 0)

    def on_train_begin(self, logs=None):
        if distributed.size() > 1:
            if self.root_rank >= distributed.size():
                raise ValueError(f"root_rank {self.root_rank} is not a rank of this {distributed.size()}-worker run")
            from keras_boost.core.state import training_variables

            variables = training_variables(self.model)  # the boost state and the optimizer's too
            distributed.broadcast_variables(variables, self.root_rank)


class StopTogether(keras.callbacks.Callback):
    """Makes `model.stop_training` one decision of all workers: they all stop after the same batch.

    A callback that stops training on some workers only (a rank-0-only rule, a time budget,
    `TerminateOnNaN` on a worker whose loss alone is NaN) would leave the others waiting in
    the next step's allreduce until the stall timeout ends the job. `BoostModel.fit` adds
    this callback after the user's under a launcher with more than one worker, and routes
    `model.stop_training` through it. A request made during the epoch's batches becomes
    this worker's vote, which the next update averages with its gradients (one more scalar
    in the same collective, `keras_boost.step.loop.StopVotes`): after that update every
    worker reads the same result and stops after the same batch, one batch after the
    worker that asked (with gradient accumulation, after the next update). A request made
    at the end of an epoch (EarlyStopping, which reads the epoch logs every worker shares)
    is decided there, after the user's callbacks, by one eager collective (a max of every
    worker's request), so it stops exactly where it does in one process. Reading
    `model.stop_training` runs no collective.
    """

    def __init__(self):
        super().__init__()
        self._requested = False  # this worker's callbacks asked to stop
        self._decided = False  # the workers' common decision
        self._warned = False
        self._batch = None

    def _votes(self):
        """The step's `StopVotes` (None before the step is built, or without a boost step)."""
        return getattr(getattr(self.model, "boost_step", None), "stop_votes", None)

    def request(self, value):
        """What a callback's `model.stop_training = value` does during a distributed fit."""
        self._requested = bool(value)
        votes = self._votes()
        if votes is not None:
            votes.vote.assign(1.0 if self._requested else 0.0)
        if self._requested and self._batch is not None and not self._warned:
            self._warned = True
            when = ("after the next update (its allreduce carries the request)" if votes is not None
                    else "at the end of this epoch")
            print(f"keras_boost: rank {distributed.rank()} asked to stop training at batch {self._batch}; all "
                  f"{distributed.size()} workers stop together {when}: a worker that stopped alone would leave "
                  "the others waiting in the next step's allreduce", flush=True)

    def decision(self):
        """`model.stop_training` as Keras reads it: the workers' common decision so far."""
        return self._decided

    def set_model(self, model):
        # Keras calls it when fit starts, before any callback's on_train_begin (which may already ask).
        super().set_model(model)
        self._requested = self._decided = self._warned = False
        votes = self._votes()
        if votes is not None:
            votes.reset()  # a previous fit's vote and result

    def on_train_batch_begin(self, batch, logs=None):
        self._batch = batch
        if self._requested:  # a request made before the step was built (at the first batch) had no vote yet
            votes = self._votes()
            if votes is not None:
                votes.vote.assign(1.0)

    def on_train_batch_end(self, batch, logs=None):
        votes = self._votes()
        if votes is not None and not self._decided and float(votes.agreed.numpy()) > 0.0:
            self._decided = True  # some worker asked, and the last update told every worker

    def on_epoch_end(self, epoch, logs=None):
        self._batch = None
        votes = distributed.allreduce(tf.constant(1.0 if self._requested else 0.0, tf.float32))
        self._decided = self._decided or bool(float(votes) > 0)


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch logs across workers, so every rank sees the same numbers.

    `BoostModel` already averages its metrics; this callback is for a plain `keras.Model`
    and for values other callbacks add to the logs. Put it before the callbacks that read
    the logs (checkpoints, early stopping, TensorBoard).
    """

    def on_epoch_end(self, epoch, logs=None):
        if logs and distributed.size() > 1:
            names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
            values = [tf.constant(float(logs[n]), tf.float32) for n in names]
            for name, value in zip(names, distributed.grouped_allreduce(values, average=True)):
                logs[name] = float(value.numpy())


class AverageBatchNormStatistics(keras.callbacks.Callback):
    """Averages every BatchNormalization's moving statistics across workers at each epoch's end.

    Each worker's BatchNorms update their moving mean and variance from its own batches
    only, so after an epoch the workers' models differ in those statistics (Horovod's Keras
    callbacks leave them apart; PyTorch's DDP broadcasts rank 0's). Averaged, every rank
    holds the same model at each epoch's end (checkpoints, `evaluate` after `fit`, the model
    rank 0 saves), with statistics from every worker's data. One grouped allreduce per epoch
    of the moving statistics (ResNet50: 53 layers, 53,120 values). `BoostModel.fit` adds it
    under a launcher (not in elastic runs, whose workers change); add it yourself for a plain
    `keras.Model` with your own Horovod step. Validation inside `fit` runs before the epoch's
    end, on each worker's own statistics of that epoch.
    """

    def on_epoch_end(self, epoch, logs=None):
        if distributed.size() <= 1:
            return
        variables = [v for layer in _keras_compat.flatten_layers(self.model)
                     if isinstance(layer, keras.layers.BatchNormalization) and layer.built
                     for v in (layer.moving_mean, layer.moving_variance)]
        if variables:
            averaged = distributed.grouped_allreduce([tf.convert_to_tensor(v) for v in variables], average=True)
            for variable, value in zip(variables, averaged):
                variable.assign(value)


@keras.saving.register_keras_serializable(package="keras_boost")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`schedule(step)` multiplied by a factor that rises linearly from `start_factor` to 1."""

    def __init__(self, schedule, warmup_steps, start_factor):
        self.schedule = schedule
        self.warmup_steps = int(warmup_steps)
        self.start_factor = float(start_factor)

    def __call__(self, step):
        progress = tf.minimum(tf.cast(step, tf.float32) / float(max(self.warmup_steps, 1)), 1.0)
        return self.schedule(step) * (self.start_factor + (1.0 - self.start_factor) * progress)

    def get_config(self):
        return {
            "schedule": keras.optimizers.schedules.serialize(self.schedule),
            "warmup_steps": self.warmup_steps,
            "start_factor": self.start_factor,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["schedule"] = keras.optimizers.schedules.deserialize(config["schedule"])
        return cls(**config)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Linear learning-rate warm-up over the first epochs (Goyal et al., 2017), Horovod's callback.

    The rate rises linearly from `initial_lr * start_factor` to `initial_lr` over
    `warmup_epochs` epochs, counted in optimizer updates (so gradient accumulation is
    respected). `start_factor` defaults to `1 / number of workers`, i.e. the warm-up from
    the single-worker rate to the scaled rate `initial_lr` that Horovod recommends.

    With a float learning rate the optimizer's rate variable is set before every batch.
    With a `LearningRateSchedule` the schedule is wrapped for the duration of `fit`: the
    schedule's own value at each step is multiplied by the warm-up factor (its step count
    is not shifted), and the original schedule is put back when training ends.

    Momentum correction (Goyal et al. section 2.1, Horovod's default): Keras' SGD keeps
    `lr * gradient` inside its momentum (`m = momentum * m - lr * g`), so when the
    warm-up raises the rate from one update to the next, the momentum is multiplied by the
    ratio of the new rate to the old one first, as if it had been built at the new rate.
    That is one pass over the momentum variables per update during the warm-up (on ResNet50,
    25.6 M values); it applies to `keras.optimizers.SGD` with `momentum > 0` and is nothing
    for other optimizers (Adam's moments hold no learning rate).

    Args:
        initial_lr: the rate reached at the end of the warm-up; default: the optimizer's
            rate when training starts (ignored for a schedule).
        warmup_epochs: epochs of warm-up, > 0, default 5.
        momentum_correction: bool, default True (Horovod's): rescale SGD's momentum when
            the rate changes.
        steps_per_epoch: updates per epoch; default: what `fit` reports.
        verbose: print the rate at the end of the warm-up on rank 0.
        start_factor: keyword only, the starting fraction of `initial_lr`, in (0, 1];
            default 1 / size.

    Example (Horovod's `examples/tensorflow2/tensorflow2_keras_mnist.py`):
        >>> scaled_lr = 0.001 * keras_boost.distributed.size()
        >>> model.compile(optimizer=keras.optimizers.Adam(scaled_lr), loss=...)
        >>> model.fit(dataset, steps_per_epoch=500 // keras_boost.distributed.size(), epochs=24, callbacks=[
        ...     keras_boost.callbacks.MetricAverageCallback(),
        ...     keras_boost.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1)])
    """

    def __init__(self, initial_lr=None, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0,
                 *, start_factor=None):
        super().__init__()
        if initial_lr is not None:
            check_real("initial_lr", initial_lr, low=0, low_inclusive=False, allowed="None or a finite number > 0")
        check_real("warmup_epochs", warmup_epochs, low=0, low_inclusive=False)
        check_bool("momentum_correction", momentum_correction)
        if start_factor is not None:
            check_real("start_factor", start_factor, low=0, low_inclusive=False, high=1,
                       allowed="None or a number in (0, 1]")
        if steps_per_epoch is not None:
            check_int("steps_per_epoch", steps_per_epoch, 1, allowed="None or a positive int")
        self.initial_lr = initial_lr
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.start_factor = start_factor
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._original_schedule = None
        self._scale_momentums = None

    def _warmup_steps(self):
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch when fit cannot tell the epoch length")
        return int(round(self.warmup_epochs * steps))

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        self._factor0 = self.start_factor if self.start_factor is not None else 1.0 / distributed.size()
        self._steps = self._warmup_steps()
        self._last_step = None
        self._scale_momentums = None  # a recompiled model has new momentum variables
        schedule = _keras_compat.learning_rate_schedule(optimizer)
        if schedule is not None:
            self._original_schedule = schedule
            optimizer.learning_rate = WarmupSchedule(self._original_schedule, self._steps, self._factor0)
        elif self.initial_lr is None:
            self.initial_lr = float(keras.ops.convert_to_numpy(optimizer.learning_rate))

    def factor(self, step):
        progress = min(step / max(self._steps, 1), 1.0)
        return self._factor0 + (1.0 - self._factor0) * progress

    def on_train_batch_begin(self, batch, logs=None):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        if step > self._steps or step == self._last_step:
            return  # after the warm-up, or the next micro-batch of the same update
        if self._original_schedule is None:
            self.model.optimizer.learning_rate = self.initial_lr * self.factor(step)
        if self.momentum_correction and self._last_step is not None:
            self._correct_momentum(self.factor(step) / self.factor(self._last_step))
        self._last_step = step
        if step == self._steps and self.verbose and distributed.rank() == 0:
            rate = self.initial_lr if self._original_schedule is None else "the schedule's"
            print(f"\nLearningRateWarmupCallback: warm-up done, learning rate {rate}")

    def _correct_momentum(self, ratio):
        from keras_boost.core.adapter import applying_optimizer

        sgd = applying_optimizer(self.model.optimizer)
        if not isinstance(sgd, keras.optimizers.SGD) or not sgd.momentum or not sgd.built or ratio == 1.0:
            return
        if self._scale_momentums is None:
            momentums = list(sgd.momentums)

            def scale(r):
                for m in momentums:
                    m.assign(m * tf.cast(r, m.dtype))

            self._scale_momentums = tf.function(scale, autograph=False)
        self._scale_momentums(tf.constant(ratio, tf.float32))

    def on_train_end(self, logs=None):
        if self._original_schedule is not None:
            self.model.optimizer.learning_rate = self._original_schedule
            self._original_schedule = None


def rank_zero_only(callback):
    """Returns `callback` on rank 0 and a do-nothing callback elsewhere.

    For side-effecting callbacks (checkpoints, CSV logs, TensorBoard) that must run once
    per job, not once per worker.

    Example:
        >>> ckpt = keras_boost.callbacks.rank_zero_only(keras.callbacks.ModelCheckpoint("m.keras"))
    """
    if not isinstance(callback, keras.callbacks.Callback):
        raise TypeError(f"callback must be a keras.callbacks.Callback, got {type(callback).__name__}")
    return callback if distributed.rank() == 0 else keras.callbacks.Callback()


class BoostScalarsCallback(keras.callbacks.Callback):
    """Writes the boost scalars (loss scale, overflow, freeze group, collective count) to TensorBoard.

    Scalars are written every `update_freq` batches by rank 0 into `log_dir/boost`.

    Args:
        log_dir: TensorBoard log directory.
        update_freq: batches between two writes, default 1.
    """

    def __init__(self, log_dir, update_freq=1):
        super().__init__()
        check_int("update_freq", update_freq, 1)
        self.log_dir = str(log_dir)
        self.update_freq = update_freq
        self._writer = None
        self._batches = 0

    def on_train_begin(self, logs=None):
        if distributed.rank() == 0:
            self._writer = tf.summary.create_file_writer(f"{self.log_dir}/boost")

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._writer is None or self._batches % self.update_freq:
            return
        step = self._batches
        scalars = dict(self.model.boost_step.logs()) if getattr(self.model, "boost_step", None) else {}
        if distributed.counting():
            scalars["collectives"] = distributed.allreduce_count()
        with self._writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.scalar(f"boost/{name}", float(keras.ops.convert_to_numpy(value)))

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()


class BackupAndRestore(_keras_compat.BackupAndRestoreBase):
    """Keras' `BackupAndRestore` for Horovod jobs: rank 0 writes, atomically, and restores for every rank.

    The weights file (model, optimizer and boost state) and the metadata are written to
    temporary files and renamed into place, so a crash while writing leaves the previous
    backup usable. When training starts rank 0 reads the backup and sends the weights and
    the epoch to resume at to every worker (Horovod's way), so the directory may be on rank
    0's disk alone. Every worker resumes at the epoch Keras records (as in Keras, a backup
    taken mid-epoch resumes that epoch from its start with the mid-epoch weights; use
    `save_freq="epoch"` for exact resumption). Give it on every worker; `BoostModel.fit`
    runs Keras' own `keras.callbacks.BackupAndRestore`, given on every worker, as this one.

    Args:
        backup_dir: directory of the backup on rank 0's host (a path every worker gives
            alike; the other hosts need not see it).
        save_freq: "epoch" or a number of batches.
        delete_checkpoint: remove the backup when training ends, default True.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=False,
                         delete_checkpoint=delete_checkpoint)

    def on_train_begin(self, logs=None):
        if distributed.size() == 1:
            return super().on_train_begin(logs)
        # Rank 0 restores (Keras' code: the weights, and the epoch as the model's initial
        # epoch), then tells every worker whether it found a backup and at which epoch.
        found = [0, 0]
        if distributed.rank() == 0:
            super().on_train_begin(logs)
            found = [int(os.path.exists(self.weights_path)), int(self.model._initial_epoch or 0)]
        found = distributed.broadcast_object(found, root_rank=0)
        if not found[0]:
            return
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:  # as Keras' restore builds it: the slots travel too
            optimizer.build(self.model.trainable_variables)
        from keras_boost.core.state import training_variables

        distributed.broadcast_variables(training_variables(self.model), root_rank=0)
        self.model._initial_epoch = found[1]

    def save_backup(self):
        if distributed.rank() != 0:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        partial = os.path.join(self.backup_dir, "partial.weights.h5")
        self.model.save_weights(partial, overwrite=True)
        os.replace(partial, self.weights_path)
        metadata = f"{self.metadata_path}.partial"
        epoch, batch = self.position()
        with open(metadata, "w") as handle:
            json.dump({"epoch": epoch, "batch": batch}, handle)
        os.replace(metadata, self.metadata_path)

    def on_train_end(self, logs=None):
        distributed.barrier()  # nobody deletes the backup while another worker may still read it
        if distributed.rank() == 0:
            super().on_train_end(logs)


__all__ = ["AverageBatchNormStatistics", "BackupAndRestore", "BoostScalarsCallback", "BroadcastGlobalVariablesCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback", "StopTogether", "WarmupSchedule",
           "rank_zero_only"]
