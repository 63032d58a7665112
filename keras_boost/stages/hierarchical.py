"""Hierarchical allreduce for many workers per host, built from Horovod process sets.

Horovod's own `HOROVOD_HIERARCHICAL_ALLREDUCE` does nothing for a CPU build: 0.28.1
switches it off unless Horovod was built with NCCL or DDL (horovod/common/operations.cc,
`BackgroundThreadLoop`: "Hierarchical allreduce is not supported without NCCL or DDL"),
and its CPU allreduces (`MPIAllreduce`, `GlooAllreduce`) are flat. This stage does it in
keras_boost, in three collectives per update (per gradient dtype):

1. reduce-scatter (sum) inside each host: the host's workers split the flattened
   gradients into equal shards, each worker gets the host's sum of its shard;
2. allreduce (sum) of each shard across the hosts, among the workers that hold the same
   shard (one per host);
3. allgather inside the host: every worker has the sum of all workers; divide by the
   number of workers.

Across the network each worker sends only its shard (1/local_size of the gradients), to
one worker per host: a ring over the hosts takes 2 (hosts - 1) rounds of messages, where a
ring over all workers takes 2 (workers - 1), each as slow as the network's latency. The
bytes a host sends over the network stay about the same (about twice the gradients); the
rounds drop by local_size, and the rest runs inside the host. The result is the average
of every worker's gradient, identical on every worker, equal to the flat allreduce's up to
float summation order.

"Hosts" are the groups of workers that share Horovod's cross rank (by default), or blocks
of `local_size` consecutive ranks when `local_size` is given. The launch must be
homogeneous (the same number of workers on every host). With one host, or one worker per
host, or one worker, the stage falls back to the plain fused allreduce. It owns the
`reduce` hook, as AdaSum does: the two cannot be combined. `gradient_split_groups` does
not split its buffers (one per dtype).
"""


import tensorflow as tf

from keras_boost import distributed
from keras_boost._validation import check_optional_int
from keras_boost.core.contract import Stage

_SUMMABLE = (tf.float16, tf.float32, tf.float64)  # what Horovod 0.28.1 can reduce among the float dtypes


class HierarchicalAllreduce(Stage):
    """Averages the gradients inside each host, then across hosts, then back inside each host.

    Args:
        local_size: workers per group; default: Horovod's topology (the workers of each host,
            grouped by cross rank). When given, groups are blocks of `local_size`
            consecutive ranks (e.g. sockets, or simulating hosts on one machine); it must
            divide the number of workers.

    Raises (when the step is built): `ValueError` for a heterogeneous launch (hosts with
    different numbers of workers), a `local_size` that does not divide the number of
    workers, or elastic training (the groups would change under it).

    Example:
        >>> model.compile(optimizer="sgd", loss="mse", hierarchical_allreduce=True)
    """

    option = "hierarchical_allreduce"
    option_help = 'True or a `HierarchicalAllreduce`: the average taken inside each host, then across hosts.'

    def __init__(self, local_size=None):
        self.local_size = check_optional_int("local_size", local_size, 1)
        self.plan = None  # None: plain fused allreduce (or nothing in one process)
        self.built = False

    uses_process_sets = True  # the hosts' groups

    @classmethod
    def add_cli_arguments(cls, groups):
        groups["communication"].add_argument("--hierarchical-allreduce", action="store_true",
                                             help="reduce inside each host, then across hosts (for many workers per host)")

    @classmethod
    def option_from_cli(cls, args):
        return True if getattr(args, "hierarchical_allreduce", False) else None

    @classmethod
    def from_option(cls, value, model):
        """`compile(hierarchical_allreduce=...)`: None/False, True or a HierarchicalAllreduce."""
        if not (value is None or isinstance(value, (bool, HierarchicalAllreduce))):
            raise TypeError(f"`hierarchical_allreduce` must be None, a bool (True or False) or a "
                            f"HierarchicalAllreduce, got {value!r} ({type(value).__name__}).")
        stage = cls() if value is True else (value or None)
        if stage is not None and distributed.launch_size() != 1:
            distributed.want_process_sets("the hierarchical allreduce")  # its host groups are process sets
        return stage

    # ------------------------------------------------------------- topology
    def groups(self):
        """The hosts as lists of ranks (each sorted), in host order; eager, a collective by default."""
        size = distributed.size()
        if self.local_size is not None:
            if size % self.local_size:
                raise ValueError(f"HierarchicalAllreduce's local_size ({self.local_size}) must divide the number of "
                                 f"workers ({size}): hosts are blocks of local_size consecutive ranks")
            return [list(range(start, start + self.local_size)) for start in range(0, size, self.local_size)]
        # every worker's (cross rank, rank, workers on its host): the same list on every worker
        placed = distributed.allgather_object((distributed.cross_rank(), distributed.rank(), distributed.local_size()),
                                              name="keras_boost.hierarchical.topology")
        per_host = sorted({local for _, _, local in placed})
        if not distributed.is_homogeneous() or len(per_host) > 1:
            raise ValueError(f"hierarchical_allreduce needs the same number of workers on every host (a homogeneous "
                             f"launch); this launch has hosts with {' and '.join(map(str, per_host))} workers. Start "
                             "as many workers on every host, or switch hierarchical_allreduce off")
        hosts = {}
        for host, rank, _ in placed:
            hosts.setdefault(host, []).append(rank)
        return [sorted(hosts[host]) for host in sorted(hosts)]

    def build(self, context):
        """Registers the process sets (the same calls, in the same order, on every worker)."""
        if self.built:
            return
        self.built = True
        if distributed.size() == 1:
            return
        if distributed.elastic_launch():
            raise ValueError("hierarchical_allreduce is not supported under elastic training: its host groups are "
                             "fixed when the step is built")
        groups = self.groups()
        per_host = len(groups[0])
        if len(groups) == 1 or per_host == 1:
            return  # one host, or one worker per host: the plain fused allreduce is the same thing
        rank = distributed.rank()
        host = next(g for g in groups if rank in g)
        hosts = [distributed.add_process_set(g) for g in groups]
        # the workers that hold the same shard: the j-th worker (rank order) of every host
        across = [distributed.add_process_set([g[j] for g in groups]) for j in range(per_host)]
        self.plan = {"host": hosts[groups.index(host)], "across": across[host.index(rank)],
                     "per_host": per_host, "workers": distributed.size()}

    # ---------------------------------------------------------------- stage
    def reduce(self, grads, indices):
        if distributed.size() == 1:
            return grads
        if self.plan is None:
            return distributed.grouped_allreduce(grads)
        reduced = [None] * len(grads)
        buckets = {}
        for position, g in enumerate(grads):
            g = tf.convert_to_tensor(g)  # IndexedSlices become dense here
            buckets.setdefault(g.dtype, []).append((position, g))
        others = [(p, g) for dtype, items in buckets.items() if dtype not in _SUMMABLE for p, g in items]
        if others:  # e.g. bfloat16 (emulated by distributed.grouped_allreduce): the flat path
            for (position, _), g in zip(others, distributed.grouped_allreduce([g for _, g in others])):
                reduced[position] = g
        for dtype, items in buckets.items():
            if dtype in _SUMMABLE:
                for (position, _), g in zip(items, self._hierarchical([g for _, g in items])):
                    reduced[position] = g
        return reduced

    def _hierarchical(self, tensors):
        """The average of `tensors` (one dtype) over every worker, in three collectives."""
        plan = self.plan
        sizes = [tf.size(t) for t in tensors]
        flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
        length = tf.size(flat)
        padding = tf.math.floormod(-length, plan["per_host"])  # equal shards for the reduce-scatter
        flat = tf.pad(flat, [[0, padding]])
        shard = distributed.reducescatter(flat, process_set=plan["host"])  # this host's sum of my shard
        shard = distributed.allreduce(shard, average=False, process_set=plan["across"])  # everyone's sum
        total = distributed.allgather(shard, process_set=plan["host"])[:length]
        mean = total / tf.cast(plan["workers"], total.dtype)
        return [tf.reshape(part, t.shape if t.shape.is_fully_defined() else tf.shape(t))
                for part, t in zip(tf.split(mean, tf.stack(sizes)), tensors)]

    def get_config(self):
        return {"local_size": self.local_size}

