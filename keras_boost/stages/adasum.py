"""AdaSum as a stage of the boost step: adaptive summation of the workers' weight deltas.

MindSpore's hierarchical AdaSum (Maleki et al., MLSys 2021): workers form groups of
`device_number` (a node); gradients are averaged inside each group; every worker takes a
normal local optimizer step; the weight deltas `old - new` are combined across groups
with the recursive pairwise AdaSum rule, per tensor; the new weights are
`old - combined delta`. With one group this is ordinary averaging, with one worker a
plain step.

The combine runs on Horovod's native `op=hvd.Adasum` where Horovod can (an MPI launch, a
power-of-two number of groups, and groups that are contiguous power-of-two blocks of
ranks or single workers: inside a group the deltas are identical and AdaSum(a, a) = a),
and on the exact keras_boost implementation of the same tree everywhere else (Gloo,
other group counts). On GPUs with Horovod built with NCCL, when the groups are the nodes
(`device_number` = GPUs per node), the native combine is Horovod's hierarchical GPU
Adasum ("native_gpu": NCCL within the node, MPI across nodes); otherwise native Adasum
runs on host memory. See `keras_boost.stages.adasum_ops` and docs/adasum.md.

The old weights are read inside the step just before the local update, so AdaSum keeps
no state between steps that a checkpoint would have to carry.
"""

import logging

import tensorflow as tf

from keras_boost import distributed, _warnings

from keras_boost._validation import check_bool, check_choice, check_optional_int
from keras_boost.stages import adasum_ops
from keras_boost.core.contract import Stage, StepContext

logger = logging.getLogger("keras_boost")


def _power_of_two(n):
    return n >= 1 and n & (n - 1) == 0


class AdaSum(Stage):
    """Combines the workers' weight deltas by Adaptive Summation (MindSpore's `AdaSum`).

    Args:
        rank: this worker's rank; default: Horovod's. Must match it when given.
        device_number: workers per group (per node); default: the workers on this host
            (`local_size`). On a single machine pass 1 to combine every worker adaptively.
            Must divide the number of workers.
        group_number: number of groups; default `size // device_number`. Must equal it
            when given.
        parameter_tuple: the variables combined by MindSpore's callable form; the boost
            step passes the trained variables itself.
        backend: "auto" (native Horovod Adasum where it can run, exact fallback
            elsewhere), "native" or "exact".
        strict: what a `device_number` that does not divide the number of workers does.
            True (default, AdaSum asked for by name): a `ValueError`, at `compile` when
            the launcher's environment tells the size, else when the step is built.
            False (what boost levels use, as MindSpore does): AdaSum is turned off, with
            one warning, and gradients are averaged over every worker.

    MindSpore's callable form (`AdaSum(rank, device_number, group_number,
    parameter_tuple)(delta_weights, parameters, old_parameters)`) is `keras_boost.AdaSum`
    (`keras_boost.mindspore.cells`), a thin adapter over this stage.

    Example:
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
        ...               adasum=keras_boost.AdaSum(device_number=1))
    """

    option = "adasum"
    option_help = 'True, or an `AdaSum` stage (False: off): updates combined across worker groups by AdaSum.'
    needs_finite = False

    def __init__(self, rank=None, device_number=None, group_number=None, parameter_tuple=None, backend="auto",
                 strict=True):
        self.strict = check_bool("strict", strict)
        self.rank = check_optional_int("rank", rank, 0)
        self.device_number = check_optional_int("device_number", device_number, 1)
        self.group_number = check_optional_int("group_number", group_number, 1)
        self.backend = check_choice("backend", backend, adasum_ops.BACKENDS)
        self.parameter_tuple = tuple(parameter_tuple) if parameter_tuple is not None else None
        self.built = False  # the topology (and Horovod) is resolved at build, never at construction

    uses_process_sets = True  # groups of several workers

    @classmethod
    def launch_info(cls, capabilities):
        if capabilities["controller"] is None:
            combine = ("native_adasum", "AdaSum combine", False, "native Horovod Adasum under an MPI launch with a "
                       "power-of-two number of groups, the exact keras_boost fallback otherwise")
        else:
            native = adasum_ops.native_adasum_available(capabilities["size"])
            combine = ("native_adasum", "AdaSum combine", native,
                       "native Horovod Adasum" if native else "exact keras_boost fallback")
        info = [combine]
        if capabilities["gpus"]:
            gpu = ("hierarchical (NCCL within a node, MPI Adasum across nodes) when device_number is the GPUs per "
                   "node under MPI, CPU Adasum otherwise") if capabilities["nccl_built"] else "CPU Adasum (host memory)"
            info.append(("gpu_adasum", "GPU AdaSum", gpu, gpu))
        return info

    @classmethod
    def from_option(cls, value, model):
        """None/False, True, or an `AdaSum` stage."""
        stage = cls() if value is True else super().from_option(value, model)
        if stage is not None:
            stage.check_launch()
            stage.ask_for_process_sets()
        return stage

    def ask_for_process_sets(self):
        """When the stage will be used under a launcher: groups of several workers are Horovod
        process sets, registered when the stage is built (`distributed.want_process_sets`)."""
        if self.device_number != 1 and distributed.launch_size() != 1:
            distributed.want_process_sets("AdaSum with groups of several workers (device_number != 1)")

    def check_launch(self):
        """At compile: a strict AdaSum whose device_number cannot fit this launch is a ValueError.

        Reads the launch size from the launcher's environment (Horovod is not initialised).
        """
        size = distributed.launch_size()
        if self.strict and self.device_number is not None and size is not None and size % self.device_number:
            raise ValueError(self._mismatch(size) + "; pass a device_number that divides it (1 combines "
                             "every worker adaptively), or leave AdaSum to a boost level, which turns it off")

    def _mismatch(self, size):
        return (f"AdaSum's device_number ({self.device_number}) must divide the number of workers ({size}): "
                f"AdaSum groups are blocks of device_number workers")

    # ------------------------------------------------------------- topology
    def report(self, step):
        return {"adasum_combine": getattr(self, "combine_backend", None) or "none (one group)"}

    def check_elastic(self):
        """Refuses AdaSum topologies that need Horovod process sets (checked before any is registered)."""
        if not distributed.launched():
            return
        _, _, device_number, groups = self._resolve_topology()
        if groups > 1 and device_number > 1:
            raise ValueError(
                f"AdaSum with process sets ({groups} groups of device_number={device_number}) is not supported under "
                "elastic training: a worker that joins registers its process sets out of step with the survivors. "
                "Use AdaSum(device_number=1) (every worker its own group) or a single group with elastic training.")

    def workers_changed(self, context):
        """Re-resolves the topology (number of groups, backend) for the current workers."""
        self.check_elastic()
        self.built = False
        self.build(context)

    def _resolve_topology(self):
        size, rank = distributed.size(), distributed.rank()
        device_number = self.device_number or distributed.local_size()
        if size % device_number:
            if self.strict:
                raise ValueError(f"device_number ({device_number}) must divide the number of workers ({size})")
            # MindSpore leaves AdaSum off when the launch does not fit its groups.
            _warnings.warn(f"AdaSum is off: device_number ({device_number}) does not divide the number of workers "
                           f"({size}); gradients are averaged over every worker, as MindSpore does", UserWarning)
            device_number = size
        groups = size // device_number
        if self.group_number is not None and self.group_number != groups and device_number == (
                self.device_number or device_number):
            raise ValueError(f"group_number ({self.group_number}) must equal workers / device_number = {groups}")
        if self.rank is not None and self.rank != rank:
            raise ValueError(f"rank ({self.rank}) is not this worker's rank ({rank})")
        self.topology = (size, rank, device_number, groups)
        return self.topology

    def build(self, context):
        """Registers the Horovod process sets (the same calls, in the same order, on every worker)."""
        variables = context.variables  # AdaSum keeps no state between steps
        if self.built:
            return
        size, rank, device_number, groups = self._resolve_topology()
        self.inner_set = self.outer_set = None
        if size == 1:
            logger.info("AdaSum in a single process: every step is a plain optimizer step")
        if groups > 1 and device_number > 1:
            inner = [distributed.add_process_set(range(g * device_number, (g + 1) * device_number))
                     for g in range(groups)]
            self.inner_set = inner[rank // device_number]
        self.combine_backend = self._choose_backend(groups, device_number)
        if groups > 1 and device_number > 1 and self.combine_backend == adasum_ops.EXACT:
            outer = [distributed.add_process_set(range(local, size, device_number)) for local in range(device_number)]
            self.outer_set = outer[rank % device_number]
        self.groups = groups
        self.parameter_tuple = self.parameter_tuple or tuple(variables)
        self.built = True

    def _choose_backend(self, groups, device_number):
        if groups == 1:
            return None
        native_possible = adasum_ops.native_adasum_available(groups) and _power_of_two(device_number)
        if self.backend == adasum_ops.NATIVE and not native_possible:
            raise ValueError(
                "backend='native' needs an MPI launch, a power-of-two number of groups and a power-of-two "
                f"device_number; this run has {groups} groups of {device_number} on "
                f"{distributed.capabilities()['controller']}"
            )
        if self.backend == adasum_ops.EXACT or not native_possible:
            return adasum_ops.EXACT
        if adasum_ops.gpu_adasum_available(groups, device_number):
            return adasum_ops.NATIVE_GPU  # GPU tensors, a group per node: Horovod's hierarchical GPU Adasum
        return adasum_ops.NATIVE

    # --------------------------------------------------------------- stage
    def reduce_gradients(self, grads):
        """Averages the gradients inside this worker's group (all workers when there is one group)."""
        if distributed.size() == 1 or (self.groups > 1 and self.inner_set is None):
            return grads
        return distributed.grouped_allreduce(grads, average=True, process_set=self.inner_set)

    def reduce(self, grads, indices):
        return self.reduce_gradients(grads)

    def agree_finite(self, finite):
        return self.all_agree(finite)

    def all_agree(self, flag):
        """True on every worker only if `flag` is true on every worker (one scalar allreduce)."""
        if self.groups == 1:
            return flag  # the gradients were averaged over everyone already
        agreed = distributed.allreduce(tf.cast(flag, tf.float32), average=True)
        return tf.equal(agreed, 1.0)

    def apply_update(self, optimizer, grads, variables):
        """Local optimizer step, then the weights become `old - AdaSum(old - new)` across groups."""
        if self.groups == 1:
            optimizer.apply(grads, variables)
            return
        old = [tf.identity(v.value) for v in variables]
        with tf.control_dependencies(old):
            optimizer.apply(grads, variables)
        self.combine_into([o - v.value for o, v in zip(old, variables)], variables, old)

    def combine_into(self, delta_weights, parameters, old_parameters):
        """`parameters <- old_parameters - AdaSum(delta_weights)` across the groups; returns them.

        The stage's combine, which MindSpore's cell form (`keras_boost.AdaSum(...)(...)`,
        `keras_boost.mindspore.cells`) calls too. The stage must be built.
        """
        if self.groups == 1:
            # One group: the deltas are already identical on every worker (averaged gradients).
            for variable, old, delta in zip(parameters, old_parameters, delta_weights):
                variable.assign(old - delta)
            return parameters
        combined = adasum_ops.combine(list(delta_weights), backend=self.combine_backend,
                                      process_set=self.outer_set)
        for variable, old, delta in zip(parameters, old_parameters, combined):
            variable.assign(old - delta)
        return parameters

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """AdaSum over `device_number` workers per group. A level's AdaSum (not switched on by
        name) is turned off, with a warning, when device_number does not fit the launch, as
        MindSpore does; switched on by name (`strict`) it is an error."""
        params = boost_config.params
        if not validate and not boost_config.features["adasum"]:
            return None
        stage = cls(device_number=params["common"]["device_number"], backend=params["adasum"]["backend"],
                    strict=not validate and "adasum" in getattr(boost_config, "explicit", ()))
        if not validate:
            stage.ask_for_process_sets()
        return stage

    def get_config(self):
        return {"device_number": self.device_number, "group_number": self.group_number, "backend": self.backend,
                "strict": self.strict}

    def __call__(self, delta_weights, parameters, old_parameters):
        """MindSpore's construct: `parameters <- old_parameters - AdaSum(delta_weights)`; returns them."""
        if not self.built:
            self.ask_for_process_sets()
            with tf.init_scope():
                self.build(StepContext(None, None, tuple(self.parameter_tuple or parameters), None))
        return self.combine_into(delta_weights, parameters, old_parameters)
