"""Every private Keras touch of keras_boost, in one place.

Keras 3 has no public API for a few things keras_boost needs; each one is here with why
it is needed and since which Keras version it is known to work. Nothing else in the
package imports `keras.src` or reads a private Keras attribute. `import keras_boost`
checks the Keras version first and fails with a clear message outside the tested range.

The supported range is in `_versions.py`; the lower bound is the first
3.x whose names below all exist (`Functional`, `functional_init_arguments`,
`Layer._flatten_layers`, `Trainer._symbolic_build`, `Trainer._loss_tracker`,
`Trainer._get_metrics_result_or_logs`, `TensorFlowTrainer._autoconvert_optionals` and
`_make_function`, `BackupAndRestore._save_model`,
`Optimizer._learning_rate`, `KerasTensor._keras_history`, `Operation._inbound_nodes`).
"""

import functools

import keras

from keras_boost._versions import keras_problem  # noqa: E402


def check_keras_version(version=None):
    """Raises ImportError naming the supported range when Keras is outside it."""
    problem = keras_problem(version or keras.__version__)
    if problem:
        raise ImportError(problem)


check_keras_version()

# Since Keras 3.0: the functional model class. `BoostModel(inputs, outputs)` builds a
# functional variant of the class (Keras' own mechanism rewrites a subclass's bases for
# good, which would break every later subclass of BoostModel); LessBN rewrites graphs.
from keras.src.models.functional import Functional  # noqa: E402
from keras.src.models.model import functional_init_arguments  # noqa: E402
from keras.src.trainers.trainer import Trainer  # noqa: E402
from keras.src.layers.convolutional.base_conv import BaseConv  # noqa: E402  (Conv1D/2D/3D; one-pixel matmuls)
from keras.src.layers.convolutional.base_depthwise_conv import BaseDepthwiseConv  # noqa: E402


def get_data_adapter(*args, **kwargs):
    """Keras' own choice of data adapter for fit's arguments (since Keras 3.0).

    `BoostModel.fit` counts each worker's batches exactly as Keras will before the epoch
    starts, so that the workers can agree on the number of steps.
    """
    from keras.src.trainers.data_adapters import get_data_adapter as keras_get_data_adapter

    return keras_get_data_adapter(*args, **kwargs)


def train_validation_split(*args, **kwargs):
    """Keras' split of arrays for `validation_split` (since Keras 3.0), for the same count."""
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(*args, **kwargs)


def track_for_checkpoint(owner, trackable, name):
    """Adds a `tf.train.Checkpoint` edge from `owner` to `trackable` (TensorFlow's trackable API).

    Needed for boost state that is kept out of Keras' layer tracking (so that it is not a
    model weight) but must still be saved by `tf.train.Checkpoint`.
    """
    owner._track_trackable(trackable, name=name)


def flatten_layers(layer, include_self=True, recursive=True):
    """Every (nested) layer of `layer`. Since Keras 3.0; Keras has no public nested walk."""
    return list(layer._flatten_layers(include_self=include_self, recursive=recursive))


def symbolic_build(model, data_batch):
    """Builds a subclassed model from a data batch, as Keras' trainer does at its first trace.

    Since Keras 3.0. The TensorFlow trainer defers building subclassed models to the first
    trace; the boost step needs the variables before it runs.
    """
    model._symbolic_build(data_batch=data_batch)


def symbolic_batch(data_or_spec):
    """A batch `symbolic_build` accepts, from tensors or from a `tf.data` element spec.

    `Trainer._symbolic_build` reads only `.shape` and `.dtype` of each leaf; a
    `tf.TensorSpec`'s shape is a `TensorShape`, which it does not take, hence the tuple.
    """
    import tensorflow as tf

    def leaf(value):
        if isinstance(value, tf.TensorSpec):
            return keras.KerasTensor(tuple(value.shape.as_list()), value.dtype.name)
        return value

    return tf.nest.map_structure(leaf, data_or_spec)


# Keras' global settings that a trace reads, kept per thread (`keras.src.backend.common.global_state`):
# the global dtype policy, and the seed behind unseeded `keras.random` calls.
_THREAD_SETTINGS = ("dtype_policy", "global_random_seed", "global_seed_generator")


def thread_settings():
    """This thread's Keras global settings that a trace reads (a new thread starts without them)."""
    from keras.src.backend.common import global_state

    return {name: global_state.get_global_attribute(name) for name in _THREAD_SETTINGS}


def adopt_thread_settings(settings):
    """Gives this thread the settings `thread_settings()` read in another one."""
    from keras.src.backend.common import global_state

    for name, value in settings.items():
        if value is not None:
            global_state.set_global_attribute(name, value)


def autoconvert_optionals(model, step_function):
    """Keras' wrapper that turns `tf.experimental.Optional` leaves of a batch into None.

    Since Keras 3.5 (`TensorFlowTrainer._autoconvert_optionals`); the boost step's own
    per-group train functions wrap their step with it as Keras wraps `one_step_on_data`.
    """
    return model._autoconvert_optionals(step_function)


def make_keras_train_function(model, step_function):
    """Keras' own train function around `step_function` (`TensorFlowTrainer._make_function`, since 3.5)."""
    return model._make_function(step_function)


def update_loss_tracker(model, loss, batch_size):
    """Feeds the step's loss into the model's mean-loss metric, as `Trainer.compute_loss` does.

    Since Keras 3.0 (`Trainer._loss_tracker`; None when the model was compiled without a loss).
    """
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None:
        tracker.update_state(loss, sample_weight=batch_size)


def inbound_node(tensor):
    """The node of the functional graph that produced a symbolic `tensor`. Since Keras 3.0."""
    operation, node_index, _ = tensor._keras_history
    return operation._inbound_nodes[node_index]


def functional_structure(model):
    """A functional model's (inputs, outputs) as given to its constructor: a dict, list or
    tensor, not the flat lists of `model.inputs`/`model.outputs`. Since Keras 3.0."""
    return model._inputs_struct, model._outputs_struct


def learning_rate_schedule(optimizer):
    """The optimizer's schedule object, or None for a fixed rate.

    Since Keras 3.0; `optimizer.learning_rate` evaluates a schedule instead of returning it.
    """
    schedule = optimizer._learning_rate
    return schedule if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule) else None


def optimizer_variables(optimizer):
    """The variables a built optimizer updates, in the order it was built with; None if not built.

    Since Keras 3.0 (`BaseOptimizer._trainable_variables`); MindSpore's optimizers expose
    theirs as `optimizer.parameters`, which `GradientAccumulation(...)(loss, grads)` needs.
    """
    if not optimizer.built:
        return None
    return list(optimizer._trainable_variables)


class BoostLogsMixin:
    """Lets a model keep non-metric scalars in its step logs (Keras 3.0+).

    Keras swaps the step's logs for the (worker-averaged) metric results only when the keys
    match exactly (`Trainer._get_metrics_result_or_logs`); a model that returns extra
    scalars defines `extra_log_keys()` and those keys are carried through unchanged.
    """

    def extra_log_keys(self):
        return set()

    def _get_metrics_result_or_logs(self, logs):
        extra = self.extra_log_keys()
        if not isinstance(logs, dict) or not extra & set(logs):
            return super()._get_metrics_result_or_logs(logs)
        metrics = {k: v for k, v in logs.items() if k not in extra}
        result = dict(super()._get_metrics_result_or_logs(metrics))
        result.update({k: v for k, v in logs.items() if k in extra})
        return result


class BackupAndRestoreBase(keras.callbacks.BackupAndRestore):
    """Keras' BackupAndRestore with its save routed to a public method `save_backup`.

    Since Keras 3.0 `BackupAndRestore._save_model` writes the backup; keras_boost replaces
    it with an atomic, rank-0-only write.
    """

    def save_backup(self):  # pragma: no cover - overridden
        super()._save_model()

    @property
    def weights_path(self):
        return self._weights_path

    @property
    def metadata_path(self):
        return self._training_metadata_path

    def position(self):
        """(epoch, last batch seen) as Keras records them for the backup's metadata."""
        return self._current_epoch, self._last_batch_seen

    def _save_model(self):
        self.save_backup()


def compute_loss(model, x, y, y_pred, sample_weight):
    """`model.compute_loss(...)`, passing `training` only when the override accepts it (as Keras does)."""
    kwargs = {"x": x, "y": y, "y_pred": y_pred, "sample_weight": sample_weight}
    if _compute_loss_takes_training(type(model).compute_loss):
        kwargs["training"] = True
    return model.compute_loss(**kwargs)


@functools.lru_cache(maxsize=None)
def _compute_loss_takes_training(compute_loss):
    import inspect

    parameters = inspect.signature(compute_loss).parameters
    return "training" in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())


def training_batches(arguments):
    """A `tf.data.Dataset` of the inputs of fit's training batches, once through (fit's keyword
    `arguments`, as given to Keras; arrays batched in their order, not shuffled)."""
    import tensorflow as tf
    from keras.src.trainers.data_adapters import get_data_adapter

    x, y, weights = arguments.get("x"), arguments.get("y"), arguments.get("sample_weight")
    if arguments.get("validation_split") and arguments.get("validation_data") is None \
            and not isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        (x, y, weights), _ = train_validation_split((x, y, weights), validation_split=arguments["validation_split"])
    steps = arguments.get("steps_per_epoch")
    adapter = get_data_adapter(x, y, weights, batch_size=arguments.get("batch_size"), steps_per_epoch=steps,
                               shuffle=False)
    dataset = adapter.get_tf_dataset().map(lambda *batch: keras.utils.unpack_x_y_sample_weight(
        batch[0] if len(batch) == 1 else batch)[0])
    return dataset.take(steps) if steps is not None else dataset


def without_epoch_stalls(arguments):
    """fit's arguments with in-memory arrays given as Keras' own dataset, minus tf.data's autotuning.

    Keras feeds NumPy arrays through a `tf.data` pipeline (its `ArrayDataAdapter`) and makes a
    new iterator of it every epoch. With tf.data's autotuning on (its default), destroying the
    previous epoch's iterator waits for autotuning's thread to stop, on the main thread, at the start of every epoch; under several workers the others wait
    for it in their first collective (docs/benchmarks.md, "Epoch-start stalls"). The pipeline
    gathers batches from memory, which autotuning does not speed up. So the arrays go to Keras'
    fit as the dataset Keras' own adapter makes of them (the same batches, the same shuffling,
    its number of batches kept), with `autotune.enabled = False`. Anything other than arrays,
    an explicit `steps_per_epoch`, and a `validation_split` with arrays (split first, as Keras
    splits) are handled as Keras would; `arguments` is fit's keyword arguments.
    """
    import tensorflow as tf
    from keras.src.trainers.data_adapters import array_data_adapter
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    args = dict(arguments)
    x = args.get("x")
    if x is None or args.get("steps_per_epoch") is not None or isinstance(x, (tf.data.Dataset,
                                                                               keras.utils.PyDataset)):
        return arguments
    if not array_data_adapter.can_convert_arrays((x, args.get("y"), args.get("sample_weight"))):
        return arguments
    if args.get("validation_split") and args.get("validation_data") is None:
        (x, args["y"], args["sample_weight"]), args["validation_data"] = train_validation_split(
            (x, args.get("y"), args.get("sample_weight")), validation_split=args["validation_split"])
    batch_size = args.get("batch_size") or 32  # Keras' default
    adapter = get_data_adapter(x, args.get("y"), args.get("sample_weight"), batch_size, None,
                               args.get("shuffle", True), args.get("class_weight"))
    if not isinstance(adapter, ArrayDataAdapter):
        return arguments
    dataset = adapter.get_tf_dataset().apply(tf.data.experimental.assert_cardinality(adapter.num_batches))
    if args.get("validation_data") is not None and args.get("validation_batch_size") is None:
        args["validation_batch_size"] = batch_size  # Keras' default for validation, kept
    # the dataset shuffles as the adapter was told; Keras would warn that shuffle does nothing on a dataset
    args.update(x=without_autotune(dataset), y=None, sample_weight=None, batch_size=None, class_weight=None,
                validation_split=0.0, shuffle=False)
    return args


def without_autotune(dataset):
    """`dataset` with tf.data's autotuning off: its iterators are destroyed at once (see `without_epoch_stalls`)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def is_array_adapter(adapter):
    """Whether Keras chose its in-memory array adapter (NumPy arrays, tensors, DataFrames)."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    return isinstance(adapter, ArrayDataAdapter)
