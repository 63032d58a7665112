"""Collectives across the workers, named by position so that every worker pairs them alike.

Averages and sums (`grouped_allreduce`, `allreduce_each`, `allreduce`, bfloat16 through
an allgather), `reducescatter`, `allreduce_op` (any of Horovod's reduce operations), gathers, broadcasts, process
sets, and the `rendezvous` behind `barrier`, fit's start and evaluate across workers; in a
single process each returns its input. Also the collective
counter that tests read (`count_collectives`, `allreduce_count`).
"""

import tensorflow as tf

from keras_boost.distributed.runtime import _counter, _hvd, _state, _tracing, horovod, want_process_sets


def count_collectives(enabled=True):
    """Switches the collective counter on or off for steps traced from now on (for tests)."""
    _state.counting = bool(enabled)


def counting():
    """Whether steps traced now count their collectives."""
    return _state.counting


def allreduce_count():
    """Number of collectives run by compiled steps traced while counting was on."""
    return int(_counter().numpy())


def _count(outputs):
    """Ties the collective counter to `outputs` (inside a graph the increment runs with them)."""
    if _state.counting and tf.inside_function():
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            _counter().assign_add(1)
    return outputs


def _name(prefix):
    """`keras_boost.<prefix>.<n>` inside a trace, `keras_boost.eager.<prefix>.<n>` outside one.

    Horovod pairs the workers' tensors by name. Inside a trace, n counts from the start of
    the train step's trace (`start_trace`), in the thread that traces it, whatever a worker
    traced before and whatever other threads trace meanwhile: a worker that joins an
    elastic job traces once more than the others, and the steps of a stage's branches are
    traced in the background (`keras_boost.step.dispatch`). Eager collectives count apart, from the
    last restart of their numbering (`restart_collective_names`, which elastic training
    calls on every worker when the workers re-form), so they do not depend on which thread
    traced what.
    """
    if tf.inside_function():
        _tracing.op_index += 1
        return f"keras_boost.{prefix}.{_tracing.op_index}"
    _state.op_index += 1
    return f"keras_boost.eager.{prefix}.{_state.op_index}"


def start_trace():
    """Restarts this thread's numbering once per traced graph (call at the start of the train step)."""
    if tf.inside_function():
        graph = tf.compat.v1.get_default_graph()
        if graph not in _state.names:  # once per trace, even with steps_per_execution > 1
            _state.names[graph] = True
            _tracing.op_index = 0


def restart_collective_names():
    """Restarts the eager numbering; elastic training calls it on every worker when the workers re-form."""
    _state.op_index = 0


def grouped_allreduce(tensors, average=True, process_set=None):
    """Averages (or sums) a list of tensors across workers in one fused collective per dtype.

    Horovod fuses only tensors of one dtype (a grouped allreduce of mixed dtypes is an
    error), so a list that mixes dtypes takes one collective per dtype, in order of first
    appearance. bfloat16 tensors, which Horovod 0.28.1 cannot reduce, take one grouped
    allgather instead (`_bfloat16_allreduce`).
    """
    tensors = list(tensors)
    hvd = _hvd()
    if hvd is None or not tensors:
        return tensors
    kwargs = {} if process_set is None else {"process_set": process_set}
    by_dtype = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(_values_dtype(t), []).append(i)
    reduced = [None] * len(tensors)
    for dtype, positions in by_dtype.items():
        group = [tensors[i] for i in positions]
        if dtype == tf.bfloat16:
            outputs = _bfloat16_allreduce(hvd, group, average, kwargs)
        else:
            outputs = _count(list(hvd.grouped_allreduce(group, op=_average_or_sum(hvd, average), name=_name("allreduce"), **kwargs)))
        for i, output in zip(positions, outputs):
            reduced[i] = output
    return reduced


def allreduce_each(tensors, average=True, process_set=None):
    """Averages (or sums) each tensor in a collective of its own, counted as one reduction.

    Each tensor goes to Horovod as soon as the backward pass has produced it, as Horovod's
    `DistributedGradientTape` does, so the first gradients travel while the rest are still
    computed; Horovod's fusion buffer still packs the tensors that are ready in the same
    cycle into one allreduce. bfloat16 tensors take `grouped_allreduce`'s allgather.
    """
    tensors = list(tensors)
    hvd = _hvd()
    if hvd is None or not tensors:
        return tensors
    kwargs = {} if process_set is None else {"process_set": process_set}
    op = _average_or_sum(hvd, average)
    base = _name("allreduce")
    reduced = [None] * len(tensors)
    halves = [i for i, t in enumerate(tensors) if _values_dtype(t) == tf.bfloat16]
    if halves:
        for i, output in zip(halves, _bfloat16_allreduce(hvd, [tensors[i] for i in halves], average, kwargs)):
            reduced[i] = output
    rest = [i for i in range(len(tensors)) if reduced[i] is None]
    outputs = [hvd.allreduce(tensors[i], op=op, name=f"{base}.{n}", **kwargs) for n, i in enumerate(rest)]
    if outputs:
        _count(outputs)
    for i, output in zip(rest, outputs):
        reduced[i] = output
    return reduced


def _average_or_sum(hvd, average):
    return hvd.Average if average else hvd.Sum


def _values_dtype(tensor):
    return tensor.values.dtype if isinstance(tensor, tf.IndexedSlices) else tensor.dtype


def _bfloat16_allreduce(hvd, tensors, average, kwargs):
    """The mean (or sum) of bfloat16 tensors across workers, identical on every worker.

    Horovod 0.28.1's allreduce takes uint8, int8, int32, int64, float16, float32 and float64
    only; its allgather takes int16. Every worker gathers the others' bfloat16 bit patterns
    (as int16, one grouped allgather) and sums them in float64 in rank order (no overflow,
    no order dependence), then rounds the result to bfloat16. Received bytes per worker:
    (workers - 1) x half the float32 size, against 2 (workers - 1) / workers x the float32
    size for a ring allreduce of float32: fewer below 4 workers, as many at 4, more beyond.
    """
    dense = [tf.convert_to_tensor(t) for t in tensors]
    flat = [tf.reshape(tf.bitcast(t, tf.int16), [1, -1]) for t in dense]
    gathered = _count(list(hvd.grouped_allgather(flat, name=_name("allgather_bf16"), **kwargs)))
    reduced = []
    for tensor, rows in zip(dense, gathered):
        values = tf.cast(tf.cast(tf.bitcast(rows, tf.bfloat16), tf.float32), tf.float64)
        total = tf.reduce_sum(values, axis=0)
        if average:
            total = total / tf.cast(tf.shape(values)[0], tf.float64)
        reduced.append(tf.reshape(tf.cast(tf.cast(total, tf.float32), tf.bfloat16), tf.shape(tensor)))
    return reduced


def reducescatter(tensor, process_set=None):
    """Sums a 1-D tensor across the workers of `process_set` (default: all) and keeps this worker's part.

    The length must be a multiple of the number of workers in the set; the i-th worker of
    the set, in rank order, gets the i-th of the equal parts.
    """
    hvd = _hvd()
    if hvd is None:
        return tf.convert_to_tensor(tensor)
    kwargs = {} if process_set is None else {"process_set": process_set}
    return _count(hvd.reducescatter(tensor, op=hvd.Sum, name=_name("reducescatter"), **kwargs))


def allreduce(tensor, average=True, process_set=None):
    return grouped_allreduce([tensor], average=average, process_set=process_set)[0]


def allreduce_op(tensors, op, process_set=None, device=""):
    """Horovod's allreduce of each tensor with its reduce operation `op`, by name (`"Sum"`,
    `"Average"`, `"Min"`, `"Max"`, `"Product"`, or one a build offers, such as its MPI-only
    adaptive summation), one collective per tensor.

    `device` is Horovod's `device_dense`: "/CPU:0" runs the operation's CPU implementation
    (host memory) even on GPU tensors; "" lets Horovod pick its GPU one for GPU tensors.
    """
    hvd = horovod()
    operation = getattr(hvd, op, None)
    if operation is None:
        raise ValueError(f"`op` must name a reduce operation of horovod.tensorflow, got {op!r}")
    kwargs = {} if process_set is None else {"process_set": process_set}
    if device:  # the input on that device too: Horovod picks its GPU or CPU kernel by the input's device
        with tf.device(device):
            tensors = [tf.identity(t) for t in tensors]
    reduced = [hvd.allreduce(t, op=operation, name=_name(op.lower()), device_dense=device, **kwargs)
               for t in tensors]
    return _count(reduced)


def allgather(tensor, process_set=None):
    """Concatenates `tensor` from every worker along axis 0, in rank order."""
    hvd = _hvd()
    if hvd is None:
        return tf.convert_to_tensor(tensor)
    kwargs = {} if process_set is None else {"process_set": process_set}
    return _count(hvd.allgather(tensor, name=_name("allgather"), **kwargs))


def broadcast_variables(variables, root_rank=0):
    """Sets every variable to its value on `root_rank` (eager; call between steps)."""
    hvd = _hvd()
    if hvd is None:
        return
    for index, variable in enumerate(variables):
        value = getattr(variable, "value", variable)
        variable.assign(hvd.broadcast(value, root_rank, name=f"keras_boost.bcast.{index}"))


def broadcast_object(obj, root_rank=0):
    """Returns rank `root_rank`'s Python object on every worker."""
    hvd = _hvd()
    if hvd is None:
        return obj
    return hvd.broadcast_object(obj, root_rank=root_rank, name=_name("bcast_object"))


def allgather_object(obj, name):
    """Every worker's picklable `obj`, as a list in rank order (eager; `name` the same on every worker)."""
    hvd = _hvd()
    if hvd is None:
        return [obj]
    return list(hvd.allgather_object(obj, name=name))


def add_process_set(ranks):
    """The Horovod process set over `ranks`, registered on first use (every worker must ask in the same order).

    Asking again for the same ranks returns the set already registered (Horovod refuses a
    second registration), so several stages and models may share a process set.
    """
    hvd = horovod()
    if not _state.dynamic_process_sets:
        want_process_sets("a Horovod process set over ranks " + str(sorted(int(r) for r in ranks)))  # raises
    key = tuple(sorted(int(r) for r in ranks))
    known = _state.process_sets.get(key)
    if known is not None and known.process_set_id is not None:
        return known
    registered = hvd.add_process_set(list(key))
    _state.process_sets[key] = registered
    return registered


class CollectiveMismatch(RuntimeError):
    """The workers reached different calls that each need every worker (one would wait for ever)."""


# One name for every rendezvous: workers at different calls pair up here and find out.
_RENDEZVOUS = "keras_boost.rendezvous"
# What a rank may run while the others do something else: no collective in any of them.
_ALONE = "evaluate() (that worker's own metrics), predict(), save(), save_weights()"


def rendezvous(call, payload=None):
    """Every worker's `payload`, in rank order, once every worker has called `rendezvous` (eager).

    `call` names what the caller is about to do together with the others ("distributed.barrier()",
    "BoostModel.fit", ...). All of keras_boost's calls that need every worker outside the
    compiled step meet here under one name, so workers that reached different ones still pair
    up: each then raises `CollectiveMismatch` at once, naming what every rank called, instead
    of waiting in a collective that the others will not join.
    """
    hvd = _hvd()
    if hvd is None:
        return [payload]
    try:
        gathered = list(hvd.allgather_object((call, payload), name=_RENDEZVOUS))
    except Exception as error:  # noqa: BLE001 - Horovod's errors have no common base
        if "shut down" not in str(error):
            raise
        raise RuntimeError(
            f"rank {hvd.rank()}: {call} needs every worker, but the other workers have finished (Horovod is shut "
            "down): every rank must reach it, or none") from error
    calls = [entry[0] for entry in gathered]
    if len(set(calls)) > 1:
        ranks = {}
        for rank, name in enumerate(calls):
            ranks.setdefault(name, []).append(rank)
        said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} called {name}"
                         for name, r in ranks.items())
        raise CollectiveMismatch(
            f"rank {hvd.rank()}: the workers reached different calls that each need every worker ({said}), so each "
            f"would wait for the others for ever. Call {' and '.join(ranks)} on every rank at the same point of the "
            f"script, not inside a block that some ranks skip (such as `if rank == 0:`); what one rank may run "
            f"alone: {_ALONE}")
    return [entry[1] for entry in gathered]


def barrier():
    """Returns once every worker has called it (eager); `CollectiveMismatch` at once where another worker
    reached a different call that needs every worker (such as `BoostModel.fit`)."""
    rendezvous("distributed.barrier()")
