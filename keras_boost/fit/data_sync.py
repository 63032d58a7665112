"""Workers that agree before they train: uneven data, configuration checks, exact metrics.

`BoostModel.fit` calls `prepare_fit` on every worker before Keras' own `fit` (under a
launcher, with more than one worker). It runs **one** small collective (an allgather of a
Python object) that carries, from every worker:

- a fingerprint of what must be the same everywhere: the versions of Python, TensorFlow,
  Keras, Horovod and keras_boost (hosts installed apart drift), the model class, the
  shape and dtype of every variable, the compile configuration (optimizer, loss, metrics, boost
  options, `steps_per_execution`), and the `fit` arguments that decide how many
  collectives a worker runs (`batch_size`, `epochs`, `initial_epoch`, `steps_per_epoch`,
  validation or not, `validation_freq`, `validation_steps`). A difference raises the same
  `ValueError` on every worker, naming the field and each worker's value, before the
  first collective of `fit` (the variable broadcast), so mismatched workers never hang
  and never average tensors of different models;
- the number of batches of its training data per epoch (-1 when unknown);
- what its callbacks write (`dropin.written_paths`): a `CSVLogger` or `TensorBoard` path
  that several workers give is left to one of them, and a `BackupAndRestore` becomes the
  job's (`dropin.one_writer_per_file`);
- a digest of its training arrays (`sample_digest`): where every worker was given the same
  ones (a script written for one machine, not sharded), rank 0 says so, once per `fit`,
  and how to give each worker its part.

Uneven data, the semantics (see docs/reliability.md):

- equal known numbers of batches: nothing changes (no cost per step);
- known but different numbers: every worker runs the **smallest** number of steps each
  epoch; the others' extra batches are dropped for that epoch, like `drop_remainder`
  (arrays and shuffled datasets drop different samples each epoch: arrays are taken
  through Keras' own data adapter with its per-epoch shuffle, then `take(min)`);
- unknown number on any worker (a `tf.data` pipeline of unknown cardinality, a Python
  generator, a `PyDataset` without a length): every batch is preceded by a one-scalar
  allreduce (min) of an "I have a batch" flag inside the input pipeline, and the epoch
  ends on every worker at the first step at which any worker has no batch left. The
  flag collective is issued by the tf.data iterator, so it overlaps with the step.

Every worker therefore applies the same updates and ends with bit-identical weights.
Evaluation (`evaluate`, validation inside `fit`) runs no collective per step: every
worker evaluates all of its own data, and `metrics_result` combines the workers' metric
*states* (sums of totals and counts), so the logs are the metrics of all samples of all
workers, each weighted by its true sample count.
"""

import hashlib
import json
import math
import platform
import socket

import keras
import numpy as np
import tensorflow as tf

from keras_boost import distributed

_HAS_BATCH = "keras_boost.has_batch"
UNKNOWN = -1


# ------------------------------------------------------------- fingerprint
def _strip_names(value):
    """A config without the auto-generated names ('sgd_1', 'dense_3'), which may differ by rank."""
    if isinstance(value, dict):
        return {k: _strip_names(v) for k, v in value.items() if k != "name"}
    if isinstance(value, (list, tuple)):
        return [_strip_names(v) for v in value]
    return value


def _short(value, limit=160):
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= limit else text[:limit] + "..."


_VERSION_NAMES = {"python": "Python", "tensorflow": "TensorFlow", "keras": "Keras", "horovod": "Horovod",
                  "keras_boost": "keras_boost"}


def package_versions():
    """The versions that must agree across workers: Python, TensorFlow, Keras, Horovod, keras_boost."""
    from keras_boost._version import __version__

    return {"python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__,
            "horovod": distributed.horovod_version(), "keras_boost": __version__}


def fingerprint(model, fit_args):
    """What must be identical on every worker for `fit` to be well-defined (JSON-able).

    `host` (the worker's hostname) is carried to name where a differing version was
    found; it is not compared.
    """
    compile_config = {}
    try:
        config = model.get_compile_config() or {}
    except Exception:  # noqa: BLE001 - an exotic compile argument: compare its repr
        config = {}
    boost = config.get("boost")
    if isinstance(boost, dict) and isinstance(boost.get("stages"), dict):
        # one entry per boost option, with that stage's own configuration: differences read
        # as `boost.gradient_accumulation.max_accumulation_step`
        stages = boost["stages"]
        config = dict(config, boost={**{k: v for k, v in boost.items() if k != "stages"},
                                     **{option: stage.get("config", stage) for option, stage in stages.items()}})
    for key, value in config.items():
        compile_config[key] = json.dumps(_strip_names(value), sort_keys=True, default=repr)
    variables = [[v.path, list(map(int, v.shape)), str(v.dtype)] for v in model.variables] if model.built else None
    return {"versions": package_versions(), "host": socket.gethostname(),
            "model": type(model).__name__, "variables": variables, "compile": compile_config,
            "fit": {k: fit_args.get(k) for k in ("batch_size", "epochs", "initial_epoch", "steps_per_epoch",
                                                  "validation", "validation_freq", "validation_steps")}}


def _loads(text):
    return None if text is None else json.loads(text)


def _first_difference(a, b, path):
    """The dotted path of the first leaf where two JSON values differ, and both leaves."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{index}]")
    return path, a, b


def _differences(prints):
    """Human-readable differences between rank 0's fingerprint and the others'."""
    base = prints[0]
    found = []
    for rank, other in enumerate(prints[1:], start=1):
        mine, theirs = base.get("versions") or {}, other.get("versions") or {}
        for key in [k for k in _VERSION_NAMES if k in mine or k in theirs]:
            if mine.get(key) != theirs.get(key):
                found.append(f"{_VERSION_NAMES[key]} version: rank 0 (host {base.get('host')}) has {mine.get(key)}, "
                             f"rank {rank} (host {other.get('host')}) has {theirs.get(key)}; install the same "
                             "versions on every host")
        if other["model"] != base["model"]:
            found.append(f"model class: rank 0 has {base['model']}, rank {rank} has {other['model']}")
        a, b = base["variables"], other["variables"]
        if a is not None and b is not None:
            if len(a) != len(b):
                found.append(f"number of model variables: rank 0 has {len(a)}, rank {rank} has {len(b)}")
            for va, vb in zip(a, b):
                if va[1:] != vb[1:]:
                    found.append(f"variable shapes: rank 0 has {va[0]} {tuple(va[1])} {va[2]}, rank {rank} has "
                                 f"{vb[0]} {tuple(vb[1])} {vb[2]}")
                    break
        for key in sorted(set(base["compile"]) | set(other["compile"])):
            if base["compile"].get(key) != other["compile"].get(key):
                path, mine, theirs = _first_difference(_loads(base["compile"].get(key)),
                                                       _loads(other["compile"].get(key)), key)
                found.append(f"compile option {path!r}: rank 0 has {_short(mine)}, rank {rank} has {_short(theirs)}")
        for key, value in base["fit"].items():
            if other["fit"].get(key) != value:
                found.append(f"fit argument {key!r}: rank 0 has {value!r}, rank {rank} has {other['fit'].get(key)!r}")
    return found


def sample_digest(arrays):
    """`(digest, samples)` of in-memory training arrays, or None for other data.

    The digest hashes every array's shape and dtype and 16 rows spread over it: cheap at any
    size, and equal on workers that were given the same arrays (a script written for one
    machine loads the whole data set on every worker).
    """
    leaves = [a for a in tf.nest.flatten(arrays) if a is not None]
    if not leaves or not all(isinstance(a, np.ndarray) and a.ndim >= 1 for a in leaves) or not len(leaves[0]):
        return None
    rows = np.unique(np.linspace(0, len(leaves[0]) - 1, 16).astype(np.int64))
    digest = hashlib.sha1()
    for array in leaves:
        digest.update(repr((array.shape, array.dtype.str)).encode())
        digest.update(np.ascontiguousarray(array[rows]).tobytes())
    return digest.hexdigest(), len(leaves[0])


def same_data_line(samples):
    """The line rank 0 prints when every worker was given the same training arrays, or None.

    `samples`: every worker's `sample_digest` (None where it was not arrays).
    """
    if len(samples) < 2 or samples[0] is None or any(s != samples[0] for s in samples):
        return None
    return (f"keras_boost: the {len(samples)} workers were given the same {samples[0][1]} training samples, so each "
            "trains on all of them: an epoch takes as many steps as in one process, and with one shuffle seed every "
            "worker computes the same gradients. To split each epoch's samples across the workers, give each its "
            "part: keras_boost.app.data.shard((x, y), distributed.rank(), distributed.size()) (Horovod's keras_mnist "
            "example keeps the whole data on every worker and divides the epochs by their number instead)")


def check_agreement(model, fit_args, local_steps, callbacks=None, samples=None):
    """One allgather: raises ValueError on a configuration mismatch; returns every worker's steps.

    `callbacks`: fit's list of callbacks, or None; its file writers are settled in place
    (`dropin.one_writer_per_file`), and rank 0 prints what changed. `samples`: this
    worker's `sample_digest`; rank 0 says when every worker was given the same arrays.
    """
    from keras_boost.fit import dropin

    mine = {"print": fingerprint(model, fit_args), "steps": int(local_steps),
            "writes": dropin.written_paths(callbacks or []), "samples": samples}
    gathered = distributed.rendezvous("BoostModel.fit", mine)  # CollectiveMismatch where another rank is elsewhere
    differences = _differences([g["print"] for g in gathered])
    if differences:
        raise ValueError(
            f"the {len(gathered)} workers were started with different configurations, so fit would hang or "
            "average unrelated tensors; make them identical: " + "; ".join(differences[:6]))
    lines = [same_data_line([g["samples"] for g in gathered])]
    if callbacks is not None:
        lines += dropin.one_writer_per_file(callbacks, [g["writes"] for g in gathered], distributed.rank())
    if distributed.rank() == 0:
        for line in filter(None, lines):
            print(line, flush=True)
    return [g["steps"] for g in gathered]


# ------------------------------------------------------------ uneven data
def _num_batches(adapter):
    try:
        steps = adapter.num_batches
    except (NotImplementedError, TypeError):
        return UNKNOWN
    return UNKNOWN if steps is None or steps < 0 else int(steps)


class _FirstBatches(keras.utils.PyDataset):
    """The first `steps` batches of a `PyDataset` (every epoch)."""

    def __init__(self, dataset, steps):
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset = dataset
        self.steps = steps

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        return self.dataset[index]

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()


def _zeros_of(spec):
    shape = [0 if d is None else d for d in spec.shape.as_list()] if spec.shape.rank is not None else [0]
    return tf.zeros(shape, spec.dtype)


def end_together(dataset):
    """`dataset`, ending on every worker at the first batch that some worker does not have.

    Each element is paired with a flag (1: a batch, 0: the end) that is min-allreduced
    across workers; the pipeline stops at the first 0. Every worker runs exactly one flag
    collective more than the common number of batches, so none waits for another.
    """
    if distributed.size() == 1:
        return dataset
    hvd = distributed.horovod()
    spec = dataset.element_spec
    end = tf.data.Dataset.from_tensors((tf.constant(0, tf.int32), tf.nest.map_structure(_zeros_of, spec)))

    @tf.autograph.experimental.do_not_convert
    def with_flag(*element):
        element = element[0] if len(element) == 1 else element
        return tf.constant(1, tf.int32), element

    @tf.autograph.experimental.do_not_convert
    def agree(flag, element):
        return hvd.allreduce(flag, op=hvd.Min, name=_HAS_BATCH), element

    @tf.autograph.experimental.do_not_convert
    def everyone_has_one(flag, element):
        return flag > 0

    @tf.autograph.experimental.do_not_convert
    def unflag(flag, element):
        return element

    synced = dataset.map(with_flag).concatenate(end).map(agree).take_while(everyone_has_one).map(unflag)
    options = tf.data.Options()
    options.experimental_optimization.map_parallelization = False  # one flag collective at a time
    options.deterministic = True
    return synced.with_options(options)


_FIT_DEFAULTS = {"x": None, "y": None, "batch_size": None, "epochs": 1, "validation_split": 0.0,
                 "validation_data": None, "shuffle": True, "class_weight": None, "sample_weight": None,
                 "initial_epoch": 0, "steps_per_epoch": None, "validation_steps": None, "validation_freq": 1}


def prepare_fit(model, arguments, callbacks=None):
    """Checks the workers agree and evens out their data; returns the arguments for Keras' fit.

    `arguments`: fit's keyword arguments (positional ones already bound to names);
    `callbacks`: fit's list of callbacks, whose file writers are settled in place
    (`check_agreement`). Does nothing with a single worker.
    """
    if distributed.size() == 1:
        return arguments
    from keras_boost._keras_compat import get_data_adapter, is_array_adapter, train_validation_split, without_autotune

    args = dict(_FIT_DEFAULTS)
    args.update(arguments)
    x = args["x"]
    is_array_like = not isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) and not _is_generator(x)
    # the arrays as given (Keras' validation split below makes tensors of them)
    samples = sample_digest((x, args["y"], args["sample_weight"])) if is_array_like else None
    if is_array_like and args["batch_size"] is None and args["steps_per_epoch"] is None:
        args["batch_size"] = 32  # Keras' default, made explicit so that it is compared
    fit_args = {**args, "validation": bool(args["validation_data"] is not None or args["validation_split"])}
    adapter = None
    if args["steps_per_epoch"] is not None:
        local_steps = int(args["steps_per_epoch"])  # the user decides; compared below
    elif isinstance(x, tf.data.Dataset):
        cardinality = int(x.cardinality())
        local_steps = cardinality if cardinality >= 0 else UNKNOWN
    elif isinstance(x, keras.utils.PyDataset):
        try:
            steps = x.num_batches
        except NotImplementedError:
            steps = None
        local_steps = UNKNOWN if steps is None else int(steps)
    elif is_array_like:
        if args["validation_split"] and args["validation_data"] is None:
            (args["x"], args["y"], args["sample_weight"]), args["validation_data"] = \
                train_validation_split((x, args["y"], args["sample_weight"]),
                                                     validation_split=args["validation_split"])
            args["validation_split"] = 0.0
        n = len(tf.nest.flatten(args["x"])[0])
        local_steps = math.ceil(n / args["batch_size"])
    else:  # a generator: Keras' adapter reads its first batch; train on the adapter's dataset
        adapter = get_data_adapter(x, args["y"], args["sample_weight"], args["batch_size"], None,
                                   args["shuffle"], args["class_weight"])
        local_steps = _num_batches(adapter)

    steps = check_agreement(model, fit_args, local_steps, callbacks, samples)
    if args["steps_per_epoch"] is not None:
        return args
    known = all(s >= 0 for s in steps)
    if known and min(steps) == 0:
        empty = [r for r, s in enumerate(steps) if s == 0]
        raise ValueError(f"rank(s) {empty} have no training batch (batches per worker: {steps}); give every "
                         "worker at least one batch")
    if known and len(set(steps)) == 1:
        return args  # even: Keras' own path, nothing added
    common = min(steps) if known else None
    if isinstance(x, keras.utils.PyDataset) and known:
        args["x"] = _FirstBatches(x, common)
        return args
    if isinstance(x, tf.data.Dataset):
        args["x"] = _first(x, common) if known else end_together(x)
        return args
    if adapter is None:
        adapter = get_data_adapter(args["x"], args["y"], args["sample_weight"], args["batch_size"], None,
                                   args["shuffle"], args["class_weight"])
    dataset = adapter.get_tf_dataset()
    if is_array_adapter(adapter):  # in-memory arrays: no per-epoch stall (_keras_compat.without_epoch_stalls)
        dataset = without_autotune(dataset)
    if args["validation_data"] is not None and args.get("validation_batch_size") is None:
        args["validation_batch_size"] = args["batch_size"]  # Keras' default for validation, kept
    # `shuffle` is the adapter's now (it reshuffles the arrays each epoch): Keras' fit would warn that it ignores it
    args.update(x=_first(dataset, common) if known else end_together(dataset), y=None, sample_weight=None,
                batch_size=None, class_weight=None, shuffle=False)
    return args


def _first(dataset, steps):
    """The first `steps` batches of `dataset`, of known length: Keras' adapters give datasets of unknown
    cardinality, with which fit's first epoch would not know its length (no progress bar, no
    `params["steps"]` for callbacks) and would warn at its end that the input ran out of data."""
    return dataset.take(steps).apply(tf.data.experimental.assert_cardinality(steps))


def _is_generator(x):
    import types

    return isinstance(x, types.GeneratorType) or (hasattr(x, "__next__") and hasattr(x, "__iter__")
                                                  and not hasattr(x, "__len__"))


# ---------------------------------------------------------------- metrics
def metrics_result(model, compute):
    """`compute()` (the metric results) on the metric states summed over the workers.

    Metric variables aggregated by "sum" (totals, counts, confusion matrices: every Keras
    metric of that kind) are summed, the others averaged; the results are then computed
    once from these global states and the local states are put back. With equal sample
    counts this equals the average of the workers' results; with unequal ones it weights
    every sample the same.
    """
    variables, seen = [], set()
    for metric in model.metrics:
        for variable in metric.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    if not variables:
        return compute()
    local = [np.array(keras.ops.convert_to_numpy(v)) for v in variables]
    summed = distributed.grouped_allreduce([tf.constant(a, tf.float64) for a in local], average=False)
    size = distributed.size()
    try:
        for variable, total in zip(variables, summed):
            value = total.numpy()
            if getattr(variable, "aggregation", "sum") != "sum":
                value = value / size
            variable.assign(value.astype(variable.dtype))
        return compute()
    finally:
        for variable, value in zip(variables, local):
            variable.assign(value)
