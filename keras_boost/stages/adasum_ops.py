"""The combine math of AdaSum: the pairwise rule, the recursive tree and the two backends.

AdaSum (Maleki et al., MLSys 2021) merges two update vectors `a` and `b` as

    AdaSum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal updates add up and identical updates are not double-counted. Many
updates are merged by a binary tree over the workers in rank order, layer by layer
(one dot product and two norms per tensor):

    AdaSum(g[0:n]) = AdaSum(AdaSum(g[0:h]), AdaSum(g[h:n])),  h = ceil(n / 2)

For a power of two this is exactly the tree that Horovod's native Adasum builds with
vector halving and distance doubling: at level `2^s` rank `r` pairs with `r XOR 2^s`,
and the rank whose bit `s` is clear holds the left operand. For other counts, `h =
ceil(n / 2)` keeps the tree balanced (no worker's update weighs more than twice
another's along a common direction) and keeps rank order.

Numerics follow Horovod's kernel (`horovod/common/ops/adasum/adasum.h`), so that the
exact fallback reproduces native results:
- dot products and squared norms are accumulated in float64 whatever the input type,
  as Horovod does for float32 (a float32 sum over ~10^5 squares would lose ~3 digits);
- both coefficients and the weighted sum are formed in float64 and rounded back to the
  input type after every pair, exactly where Horovod rounds its buffer;
- a coefficient is 1 when its squared norm is below `sqrt(DBL_MIN)` (a zero update
  leaves the other one unchanged), and no epsilon is added by default. MindSpore
  instead adds `eps = 1e-12` to the dot product and both norms; pass `eps=1e-12` to
  reproduce it.

Tensors with a single element ("all-scalar", every dimension 1) are averaged instead,
as MindSpore does (for non-zero scalars the AdaSum pair is already the mean of two;
the plain mean keeps equal weights for any worker count and for zero updates).
"""

import math

import numpy as np
import tensorflow as tf

from keras_boost import distributed

NATIVE = "native"
EXACT = "exact"
AUTO = "auto"
BACKENDS = (AUTO, NATIVE, EXACT)
# Resolved only (not a user choice): Horovod's hierarchical GPU Adasum, NCCL within each node
# and MPI Adasum across nodes, on GPU tensors; see `gpu_adasum_available`.
NATIVE_GPU = "native_gpu"

# The public functions hold no tensor-dependent Python control flow: AutoGraph need not
# convert them (nor, through them, Horovod's Python code).
_graph_safe = tf.autograph.experimental.do_not_convert

# Horovod's threshold below which a squared norm counts as zero (sqrt(DBL_MIN)).
_NORM_FLOOR = math.sqrt(np.finfo(np.float64).tiny)


class _Layout:
    """Static description of a flat buffer made of several tensors laid end to end."""

    def __init__(self, shapes):
        self.shapes = [tf.TensorShape(shape) for shape in shapes]
        self.sizes = [shape.num_elements() for shape in self.shapes]
        self.segment_ids = tf.constant(np.repeat(np.arange(len(self.sizes)), self.sizes), tf.int32)
        self.scalar_mask = tf.constant(np.repeat(np.array(self.sizes) == 1, self.sizes))

    def split(self, flat):
        """Cuts a flat vector back into tensors of the original shapes."""
        return [tf.reshape(part, shape) for part, shape in zip(tf.split(flat, self.sizes), self.shapes)]


def _coefficient(dot, normsq):
    coefficient = 1.0 - tf.math.divide_no_nan(dot, normsq) * 0.5
    return tf.where(normsq >= _NORM_FLOOR, coefficient, tf.ones_like(coefficient))


def _pair_flat(a, b, segment_ids, sizes, eps):
    """AdaSum of flat vectors `a` and `b`, one coefficient pair per segment.

    `segment_ids` (sorted) numbers the segment of every element; `sizes` are the
    segment lengths.
    """
    a64 = tf.cast(a, tf.float64)
    b64 = tf.cast(b, tf.float64)

    def per_segment(values):
        return tf.math.segment_sum(values, segment_ids) + eps

    dot = per_segment(a64 * b64)
    acoeff = tf.repeat(_coefficient(dot, per_segment(a64 * a64)), sizes)
    bcoeff = tf.repeat(_coefficient(dot, per_segment(b64 * b64)), sizes)
    return tf.cast(acoeff * a64 + bcoeff * b64, a.dtype)


def _tree(rows, pair):
    """Folds `rows` (in rank order) with `pair`, splitting at ceil(n / 2)."""
    if len(rows) == 1:
        return rows[0]
    half = (len(rows) + 1) // 2
    return pair(_tree(rows[:half], pair), _tree(rows[half:], pair))


def _mean(rows):
    total = tf.cast(rows[0], tf.float64)
    for row in rows[1:]:
        total += tf.cast(row, tf.float64)
    return tf.cast(total / len(rows), rows[0].dtype)


def _combine_rows(rows, layout, eps):
    """AdaSum tree over flat per-worker buffers laid out by `layout`; scalars averaged."""
    combined = _tree(rows, lambda a, b: _pair_flat(a, b, layout.segment_ids, layout.sizes, eps))
    if len(rows) == 1 or 1 not in layout.sizes:
        return combined
    return tf.where(layout.scalar_mask, _mean(rows), combined)


@_graph_safe
def adasum_pair(a, b, eps=0.0):
    """Combines two updates of one layer with the AdaSum rule.

    Args:
        a: Tensor, the update of the left subtree (lower ranks).
        b: Tensor of the same shape and dtype, the update of the right subtree.
        eps: float added to the dot product and to both squared norms. `0.0` matches
            Horovod's native Adasum; MindSpore uses `1e-12`.

    Returns:
        A tensor shaped and typed like `a`. Orthogonal inputs give `a + b`, identical
        inputs give `a`, and a zero input gives the other one.
    """
    a = tf.convert_to_tensor(a)
    b = tf.convert_to_tensor(b, dtype=a.dtype)
    flat_a = tf.reshape(a, [-1])
    segment_ids = tf.zeros_like(flat_a, dtype=tf.int32)
    combined = _pair_flat(flat_a, tf.reshape(b, [-1]), segment_ids, tf.size(flat_a)[tf.newaxis], eps)
    return tf.reshape(combined, tf.shape(a))


@_graph_safe
def adasum_tree(deltas, eps=0.0):
    """Combines the updates of one layer from several workers with the AdaSum tree.

    `AdaSum(g[0:n]) = adasum_pair(AdaSum(g[0:h]), AdaSum(g[h:n]))` with
    `h = ceil(n / 2)`, which for a power of two is Horovod's own pairing. A tensor with
    a single element is averaged instead (MindSpore's rule for all-scalar tensors).

    Args:
        deltas: non-empty list of tensors of one static shape and dtype, one per worker
            (or group), in rank order.
        eps: see `adasum_pair`.

    Returns:
        A tensor shaped and typed like `deltas[0]`.
    """
    deltas = [tf.convert_to_tensor(delta) for delta in deltas]
    if not deltas:
        raise ValueError("adasum_tree needs at least one tensor.")
    layout = _Layout([deltas[0].shape])
    rows = [tf.reshape(delta, [-1]) for delta in deltas]
    return layout.split(_combine_rows(rows, layout, eps))[0]


def _dtype_groups(tensors):
    """Indices of `tensors` grouped by dtype, in first-seen order."""
    groups = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    return list(groups.values())


@_graph_safe
def exact_adasum_allreduce(tensors, process_set=None, eps=0.0):
    """AdaSum of each tensor across workers, computed identically on every worker.

    Each worker's tensors are flattened into one buffer per dtype and gathered with a
    single `distributed.allgather`; every worker then applies the `adasum_tree` rule to
    the gathered rows in rank order, so all workers get bit-identical results. Runs
    under Gloo and MPI and for any worker count. Usable inside `tf.function`.

    Args:
        tensors: list of tensors with static shapes (e.g. weight deltas).
        process_set: Horovod process set to combine over; `None` for all workers.
        eps: see `adasum_pair`.

    Returns:
        A list of tensors shaped and typed like `tensors`; the input itself in a single
        process.
    """
    tensors = [tf.convert_to_tensor(tensor) for tensor in tensors]
    if not tensors or not distributed.is_distributed():
        return tensors
    combined = list(tensors)
    for indices in _dtype_groups(tensors):
        layout = _Layout([tensors[i].shape for i in indices])
        flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], axis=0)
        gathered = distributed.allgather(flat[tf.newaxis], process_set=process_set)
        rows = tf.unstack(gathered, num=_group_size(process_set), axis=0)
        for index, result in zip(indices, layout.split(_combine_rows(rows, layout, eps))):
            combined[index] = result
    return combined


def _group_size(process_set):
    return distributed.size() if process_set is None else process_set.size()


def native_adasum_available(groups):
    """Horovod's Adasum runs only on an MPI launch and a power-of-two number of groups."""
    return bool(distributed.launch_facts()["mpi"] and groups >= 1 and groups & (groups - 1) == 0)


def gpu_adasum_available(groups, device_number):
    """Whether Horovod's hierarchical GPU Adasum computes keras_boost's AdaSum over `groups` groups.

    Horovod runs Adasum on GPU tensors as an NCCL sum inside each node, then Adasum
    across nodes (MPI), then an NCCL broadcast back: that is AdaSum over the groups when
    the groups are the nodes (`device_number == local_size`, every node the same size),
    their number is a power of two, and Horovod was built with NCCL and runs under MPI.
    """
    facts = distributed.launch_facts()
    return facts["gpu"] and adasum_gpu_plan(groups, device_number, facts["local_size"], facts["size"], facts["nccl"],
                                            facts["mpi"], facts["homogeneous"])


def adasum_gpu_plan(groups, device_number, local_size, size, nccl_built, mpi_enabled, homogeneous):
    """Pure rule of `gpu_adasum_available` (testable without GPUs)."""
    return bool(nccl_built and mpi_enabled and homogeneous and device_number == local_size
                and groups * device_number == size and groups >= 1 and groups & (groups - 1) == 0)


@_graph_safe
def native_adasum_allreduce(tensors, process_set=None, hierarchical_gpu=False):
    """Horovod's native Adasum of each tensor (MPI launch, power-of-two worker count).

    Horovod applies the AdaSum rule to every tensor, single-element ones included, and
    in version 0.28.1 accepts only the global process set. Use `combine` for
    keras_boost's semantics.

    By default Horovod's CPU Adasum runs (on GPU tensors too, through host memory), whose
    tree is over all workers. `hierarchical_gpu=True` runs Horovod's GPU Adasum instead
    (NCCL sum within each node, Adasum across nodes): for workers whose tensors are equal
    within each node (a group per node) the node sums are `local_size` times the node's
    tensor, which is divided out again, so both give the AdaSum tree over the nodes.
    """
    tensors = list(tensors)
    if not tensors:
        return []
    if not hierarchical_gpu:
        return distributed.allreduce_op(tensors, "Adasum", process_set=process_set, device="/CPU:0")
    local_size = distributed.local_size()
    reduced = distributed.allreduce_op(tensors, "Adasum", process_set=process_set)
    return [r / tf.cast(local_size, r.dtype) for r in reduced]


def resolve_backend(backend=AUTO, process_set=None):
    """The backend `combine` uses: `"native"` where Horovod's Adasum can run, else `"exact"`.

    Native Adasum needs an MPI launch, a power-of-two number of workers and the global
    process set.
    """
    if backend not in (*BACKENDS, NATIVE_GPU):
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != AUTO:
        return backend
    native = process_set is None and native_adasum_available(distributed.size())
    return NATIVE if native else EXACT


@_graph_safe
def combine(tensors, backend=AUTO, process_set=None):
    """AdaSum of each tensor across workers with keras_boost's semantics.

    Both backends give the same result up to float rounding: the AdaSum tree in rank
    order for tensors with more than one element and the plain mean for single-element
    tensors (averaged with one fused allreduce on the native backend).

    Args:
        tensors: list of tensors with static shapes.
        backend: `"auto"`, `"native"` or `"exact"`; see `resolve_backend`.
        process_set: Horovod process set to combine over; `None` for all workers.

    Returns:
        A list of tensors shaped and typed like `tensors`; the input itself in a single
        process.
    """
    tensors = [tf.convert_to_tensor(tensor) for tensor in tensors]
    if not tensors or not distributed.is_distributed():
        return tensors
    resolved = resolve_backend(backend, process_set)
    if resolved == EXACT:
        return exact_adasum_allreduce(tensors, process_set=process_set)
    is_scalar = [tensor.shape.num_elements() == 1 for tensor in tensors]
    vectors = [tensor for tensor, scalar in zip(tensors, is_scalar) if not scalar]
    scalars = [tensor for tensor, scalar in zip(tensors, is_scalar) if scalar]
    vectors = iter(native_adasum_allreduce(vectors, process_set=process_set,
                                           hierarchical_gpu=resolved == NATIVE_GPU))
    scalars = iter(distributed.grouped_allreduce(scalars, average=True, process_set=process_set))
    return [next(scalars) if scalar else next(vectors) for scalar in is_scalar]
