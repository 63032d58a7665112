"""The stage contract: what every boost stage implements, and the context it is built from.

A boost step is a loop over stages at fixed hook points (see docs/architecture.md):

    forward + loss       inside every `around_forward(model)` context (fused BatchNorm: kernels)
    -> scale_loss        (loss)                        loss scale
    -> gradients of the variables the step trains      (select_branch: freeze)
    -> local_gradients   (grads, indices)              loss scale: unscale
    -> window            (grads, indices)              accumulation: add; go on at a boundary
    -> encode            (grads, indices)              compression: cast to the wire dtype
    -> reduce            (grads, indices)              default: average (one grouped allreduce); AdaSum: inside its group;
                                                       hierarchical: inside hosts, then across them
    -> decode            (grads, indices)              compression: cast back
    -> column_sums       (grads, variables)            gradient centralization: its per-channel sums, once,
                                                       for the finite check and its own transform
    -> agree_finite      (finite)                      AdaSum: all groups agree
    -> should_skip       (finite)                      loss scale, NaN guard: one decision for all workers
    -> transform         (grads, variables)            gradient centralization
    -> apply_update      (optimizer, grads, variables) default: optimizer.apply; AdaSum: local step + combine,
                                                       inside every `around_update(optimizer)` context (fused update: kernels)
    -> after_update      ()                            freeze: advance the sequence
    -> logs              ()

A stage overrides only the hooks it needs; the loop calls a hook only on the stages that
override it. Hooks that produce a value (`reduce`, `apply_update`, `select_branch`, `window`) may
be overridden by at most one stage of a step. Every stage is built once, eagerly, from one
`StepContext`, and creates its state with `context.state.add_state(...)`, so checkpoints
carry it. `get_config()` returns plain JSON values (variables by `path`), and
`from_config(config)` rebuilds the stage; variables named by path are resolved at `build`.

A stage that decides *which compiled step runs* overrides `select_branch`: it returns the
index lists of the variables each branch trains and a selector; nothing in the contract
ties the branches to one `tf.switch_case`. When it also answers `upcoming_branch()` (and a
window stage `steps_to_boundary()`), `BoostModel.fit` compiles one function per branch, when
the branch is first needed, and picks it from Python between steps
(`keras_boost.step.dispatch`); `enter_branch(branch)` then runs inside that branch's step. `branches_ahead()` lets it
trace the branches still to come in the background while the first ones train.
"""

import contextlib
import dataclasses
import numbers

import tensorflow as tf


@dataclasses.dataclass
class StepContext:
    """What a stage is built from.

    Attributes:
        model: the Keras model being trained.
        optimizer: its `keras.optimizers.Optimizer` (already built on `variables`).
        variables: `model.trainable_variables` when the step was built, in order; hooks
            receive gradient lists with `indices` into this list.
        state: the `BoostState` that holds every stage's variables.
    """

    model: object
    optimizer: object
    variables: list
    state: object


@dataclasses.dataclass
class Window:
    """What `window` returns: go on only at `boundary`, with `grads()`, then call `close()`."""

    boundary: object
    grads: object
    close: object


HOOKS = ("around_forward", "scale_loss", "local_gradients", "window", "encode", "reduce", "decode", "column_sums",
         "agree_finite", "should_skip",
         "transform", "around_update", "apply_update", "after_update", "select_branch", "logs")
SINGLE_HOOKS = ("window", "reduce", "column_sums", "apply_update", "select_branch")


class Stage:
    """Base of every boost stage. Subclasses set `option` (their `compile` keyword) and override hooks.

    Class attributes:
        option: the `BoostModel.compile` keyword that makes this stage (the registry's key).
        needs_finite: whether the loop must compute "all reduced gradients are finite"
            for this stage's `should_skip`.
        default_for: the single hook this stage fills when no other stage of the step owns
            it (the registry then makes it from its option): the averaging `reduce` and the
            optimizer's `apply_update` are such defaults.
        measurable: whether a boost level's instance of this stage can measure what it
            saves or costs in `fit` and be switched off between steps, without retracing
            (`keras_boost.step.tuning`): it then overrides `measure` and reads `active()`
            in its hooks.
        level_section: the boost configuration's feature (and section) that switches a
            level's instance on (`config.BoostConfig.measured` says whether it is measured).
    """

    option = None
    option_help = None  # what `compile(<option>=...)` takes, in a sentence (BoostModel's docstring lists it)
    needs_finite = False
    default_for = None
    measurable = False
    level_section = None
    log_keys = ()  # the keys of what `logs` returns (known before the stage is built)
    carries_votes = False  # a `reduce` owner: whether a scalar added to its list is averaged in the same collective
    switch = None  # a boolean tf.Variable once `add_switch` made one: the stage acts while it is True
    on_with_true = False  # whether `compile(<option>=True)` makes the stage with its defaults (`from_option`)
    number_argument = None  # the constructor argument that `compile(<option>=<a number>)` sets (`from_option`)

    def build(self, context):
        """Creates the stage's state from `context` (eager, once)."""

    def check_optimizer(self, optimizer):
        """Raises `TypeError`/`ValueError` at `compile` when the stage cannot work with `optimizer`."""

    # -------------------------------------------------------------- hooks
    def around_forward(self, model):
        """A context manager the step enters around the forward pass (e.g. the fused BatchNorm's kernels)."""
        return contextlib.nullcontext()

    def scale_loss(self, loss):
        return loss

    def local_gradients(self, grads, indices):
        return grads

    def window(self, grads, indices):
        """A `Window`, or None to go on with `grads` now."""
        return None

    def encode(self, grads, indices):
        """The gradients as they go over the wire, right before `reduce` (once per update).

        E.g. compression casts them to float16. Every stage that overrides it runs, in
        registry order; `decode` undoes it right after `reduce`, in reverse order.
        """
        return grads

    def reduce(self, grads, indices):
        return grads

    def decode(self, grads, indices):
        """The reduced gradients back in the form the rest of the step expects, right after `reduce`.

        E.g. compression casts them back to float32, before `agree_finite`/`should_skip` see them.
        """
        return grads

    def column_sums(self, grads, variables):
        """For a `transform` stage that sums its gradients anyway: a list parallel to `grads`.

        Each entry is a tensor of sums of one gradient along some of its axes (so finite
        exactly when the gradient is, up to overflow near float32's limit), or None for a
        gradient the stage does not sum. The loop asks for them once per update, before the
        finite check, which adds these sums instead of reading those gradients again, and
        passes them back as `transform(grads, variables, sums=...)`. None: no sums.
        """
        return None

    def agree_finite(self, finite):
        return finite

    def should_skip(self, finite):
        """A boolean tensor: True skips the update on every worker. `finite` is None unless `needs_finite`."""
        return None

    def transform(self, grads, variables):
        return grads

    def around_update(self, optimizer):
        """A context manager the step enters around `apply_update` (e.g. the fused update's kernels)."""
        return contextlib.nullcontext()

    def apply_update(self, optimizer, grads, variables):
        optimizer.apply(grads, variables)

    def after_update(self):
        pass

    def select_branch(self):
        """(list of index lists, selector) where selector() gives the branch to run; None for one branch."""
        return None

    # Python-side planning: lets the train function run each branch as its own compiled
    # function, chosen from Python, instead of one `tf.switch_case` over all branches.
    def upcoming_branch(self):
        """For a `select_branch` owner: (branch, updates), Python ints read between steps.

        `branch` is the branch the next update trains; `updates` (>= 1) how many updates in a
        row train it. None when the stage cannot say (the step then falls back to its selector).
        """
        return None

    def branches_ahead(self):
        """For a `select_branch` owner: the branches the coming updates train, each once, in the
        order they first come (Python ints); empty when the stage cannot say. The train function
        traces them ahead, in the background (`keras_boost.step.dispatch`)."""
        return []

    def enter_branch(self, branch):
        """For a `select_branch` owner, inside the compiled step of `branch` (a Python int)."""

    def shares(self):
        """For a `select_branch` owner: {branch: share of the updates that train it}; {} while unknown."""
        return {}

    def gate_verdict(self, first, step, steps_left):
        """For a measurable `select_branch` owner whose branches compile one by one: whether they
        could pay back their compilation in the `steps_left` of this fit, from the first full
        step's time `first` (it compiled) and a full step's `step` (seconds, the workers' mean).
        Returns `(pays, numbers)`, as `verdict`; the base always pays (no gate)."""
        return True, ""

    def steps_to_boundary(self):
        """For a `window` owner: (steps left in this window, steps per window), Python ints; None if unknown."""
        return None

    def logs(self):
        return {}

    # ------------------------------------------------------------ lifecycle
    def fit_callbacks(self):
        """Keras callbacks this stage needs in every `fit` of its model (BoostModel adds them first)."""
        return []

    def after_fit(self, model, batches):
        """On every worker, once `fit` has returned: `batches()` is a `tf.data.Dataset` of the fit's
        training inputs, once through, as fit batched them (inputs only; arrays unshuffled), for a
        stage that ends its work with a pass over the data (SWA's BatchNorm statistics)."""

    def report_callbacks(self):
        """Callbacks that count what this stage did in a `fit`, for `report` (`keras-boost train` and
        `bench` add them; a plain `fit` runs without them)."""
        return []

    def report(self, step):
        """{name: value}: what this stage did, for the report of `keras-boost train` and `bench`."""
        return {}

    def check_elastic(self):
        """Raises ValueError where this stage cannot run under elastic training (default: it can)."""

    def workers_changed(self, context):
        """Under elastic training, at the workers' first agreement and whenever they re-form: rebuilds
        what depends on the set of workers. A stage that overrides it is built then, not before
        (its build may run collectives that must happen at the same point on every worker)."""

    # ------------------------------------------------------- command line
    uses_process_sets = False  # whether the stage may register Horovod process sets (asked for at `init`)

    @classmethod
    def add_cli_arguments(cls, groups):
        """Adds this stage's flags of `keras-boost train`; `groups`: {"training", "communication": argparse group}."""

    @classmethod
    def option_from_cli(cls, args):
        """The value of this stage's option that the parsed flags `args` ask for, or None (off)."""
        return None

    @classmethod
    def launch_info(cls, capabilities):
        """What the build and launch (`distributed.capabilities()`) allow this stage, for `keras-boost
        info`: a list of (JSON key, label, JSON value, text line)."""
        return []

    @classmethod
    def batches_per_update(cls, value):
        """How many batches one update takes when the option is `value` (a window stage: its length)."""
        return 1

    @classmethod
    def size_level_config(cls, config, updates):
        """Fits the stage's section of a boost configuration dict given to a run of `updates` updates."""

    # ------------------------------------------------------------- config
    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    @classmethod
    def from_option(cls, value, model):
        """The stage for `compile(<option>=value)`, or None when `value` switches it off.

        None and False switch it off, a stage of this class is taken as it is, True
        makes `cls()` where the class sets `on_with_true`, and a number makes
        `cls(<number_argument>=value)` where the class names that argument.
        """
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        if value is True and cls.on_with_true:
            return cls()
        if cls.number_argument and isinstance(value, numbers.Real) and not isinstance(value, bool):
            return cls(**{cls.number_argument: value})
        raise cls.bad_option(value)

    # What `compile(<option>=...)` takes besides a stage of the class, in words (for `bad_option`).
    option_values = None

    @classmethod
    def bad_option(cls, value, error=TypeError):
        """The error for `compile(<option>=value)`: the option, the value and the whole allowed set, in one style."""
        allowed = cls.option_values or ("None, a bool" if cls.on_with_true else "None, False")
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        return error(f"`{cls.option}` must be {allowed} or {article} {cls.__name__}, got {value!r} "
                     f"({type(value).__name__}).")

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """The value of this stage's option that a boost level (`config.BoostConfig`) switches on, or None.

        With `validate=True`, the value is made from the configuration's parameters even when
        the level leaves the feature off, so that bad values fail when the model is made.
        """
        return None

    # ----------------------------------------------------- self-measurement
    def add_switch(self):
        """Gives the stage a switch (a boolean variable, True) that its compiled hooks read."""
        if self.switch is None:
            with tf.init_scope():
                self.switch = tf.Variable(True, trainable=False, name=f"{self.option}_on")

    def active(self):
        """Whether the stage acts: the switch's value (a tensor) inside a step; True without a switch."""
        return tf.constant(True) if self.switch is None else self.switch.value()

    def is_on(self):
        """The same, read from Python between steps."""
        return self.switch is None or bool(self.switch.numpy())

    def switch_off(self):
        self.add_switch()
        self.switch.assign(False)

    def measure_alone(self):
        """{name: seconds}: what the stage costs timed on its own, out of the step (default: nothing).

        Called once per worker between steps; the workers' numbers are averaged before `verdict`.
        """
        return {}

    def verdict(self, times, alone):
        """Whether this stage pays on this model and launch, from numbers every worker shares.

        `times`: {branch: median seconds of one step of that branch}, branch 0 being the
        full step; `alone`: this stage's `measure_alone`, averaged over the workers. Returns
        `(pays, numbers)`: whether to keep the stage, and a short text of the numbers behind
        the verdict, for the line `fit` prints. The base keeps the stage: a measurable stage
        overrides it.
        """
        return True, f"{type(self).__name__} gives no verdict of its own, so it stays on"

    def overrides(self, hook):
        return getattr(type(self), hook) is not getattr(Stage, hook)


def run_if(predicate, fn):
    """Runs `fn` (for its effects) inside the compiled step only when `predicate` holds."""
    def taken():
        fn()
        return tf.constant(True)

    return tf.cond(predicate, taken, lambda: tf.constant(False))


def map_values(fn, grad):
    """`fn(grad)`; for a `tf.IndexedSlices` gradient (an `Embedding`'s), `fn` of its values, kept sparse.

    For elementwise maps that send zero to zero (scaling, casting): a dense gradient
    made of the sparse one would have `fn`'s values in the same rows and zeros elsewhere.
    """
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


def all_finite(grads, sums=None):
    """True when every entry of every gradient is finite.

    `sums`: None, or a list parallel to `grads` of partial sums a stage computed anyway
    (`Stage.column_sums`), added instead of the float32/float64 gradients they sum.

    float32/float64 gradients are checked through their sum: a NaN or an infinity anywhere
    makes it non-finite (inf - inf is NaN), and one reduction per gradient reads each value
    once, where `reduce_all(is_finite(g))` also writes and reads a boolean copy (about 25%
    cheaper on ResNet50's gradients here). The sum of finite values can itself overflow
    only when the gradients are near float32's limit (3.4e38), where the update would not
    be finite either. Half-precision gradients, whose sums overflow at 65504, are checked
    element by element. A `tf.IndexedSlices` gradient (an `Embedding`'s) is checked through
    its values, never made dense.
    """
    sums = [None] * len(grads) if sums is None else sums
    pairs = [(g.values if isinstance(g, tf.IndexedSlices) else g, s) for g, s in zip(grads, sums) if g is not None]
    wide = [g if s is None else s for g, s in pairs if g.dtype in (tf.float32, tf.float64)]
    checks = [tf.reduce_all(tf.math.is_finite(g)) for g, _ in pairs if g.dtype not in (tf.float32, tf.float64)]
    if wide:
        checks.append(tf.math.is_finite(tf.add_n([tf.cast(tf.reduce_sum(g), tf.float64) for g in wide])))
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
