"""Gradient freezing, the stage of the boost step: which group trains, and where the sequence stands."""

import reprlib
import weakref

import keras
import numpy as np
import tensorflow as tf

from keras_boost import distributed
from keras_boost.core.contract import Stage
from keras_boost.graph.less_bn import removed_batchnorms
from keras_boost.stages.freeze.groups import resolve_paths
from keras_boost.stages.freeze.optimizer import FreezeOpt, GradientFreeze, freeze_cell


# The most of a step that freezing can save: the backward pass (about two thirds of a
# training step: two matrix products per forward one), had every partial group frozen all
# of it. Real savings are far smaller (docs/freeze.md), so the gate switches freezing off only
# where it cannot pay.
BACKWARD_SHARE = 2.0 / 3.0

class FreezeStage(Stage):
    """The gradient-freeze stage of the boost step: which group trains, and where the sequence stands.

    Made from a `GradientFreeze` (groups split from the model when the step is built) or
    a ready `FreezeOpt`. Its position in the sequence is a variable, so a restored run
    continues the same schedule; it advances once per optimizer update (a whole
    accumulation window trains one group) and wraps around at the end of the sequence.
    """

    option = "gradient_freeze"
    option_help = ("True (a `GradientFreeze` with MindSpore's defaults), a `GradientFreeze` (turned into groups of "
                   'this model), a `FreezeOpt`, or False.')
    measurable = True
    level_section = "grad_freeze"
    # A boost level's freezing is kept when the schedule's mean step is at least this much
    # shorter than the full step (`verdict`); an explicit one always stays.
    min_saving = 0.02
    # A level's freezing also needs LessBN to have removed a BatchNorm: on its partial steps
    # the frozen layers skip their update, which costs accuracy in a fit of a given length,
    # and on the families where O1 kept or gained accuracy, LessBN (the FN head, GC) made up
    # for it. Alone, on keras-io's ConvMixer (no BatchNorm removed), O1 was below O0 in most
    # runs (docs/freeze.md). So on a model where LessBN removed none
    # (or is off) a level's freezing is switched off when the step is built, with one line.
    # An explicit freezing, or one whose `grad_freeze` section the configuration gives, stays.

    def __init__(self, source):
        if not isinstance(source, (GradientFreeze, FreezeOpt, _SavedFreezeOpt)):
            raise TypeError(f"`gradient_freeze` must be None, a bool, a GradientFreeze or a FreezeOpt, got "
                            f"{reprlib.repr(source)} ({type(source).__name__})")
        self.source = source
        self.plan = None

    @classmethod
    def from_option(cls, value, model):
        """None or False (off; False also switches off a boost level's freezing), True (a
        `GradientFreeze` with MindSpore's defaults), a `GradientFreeze`, a `FreezeOpt` or a
        ready `FreezeStage`."""
        if value is None or value is False:
            return None
        if value is True:
            return cls(GradientFreeze())
        if isinstance(value, FreezeStage):
            return value
        return cls(value)

    @classmethod
    def size_level_config(cls, config, updates):
        """A `grad_freeze` section given to a run is sized to its updates (`total_steps`) by default.

        Without one the level's own freezing keeps its defaults (its continuous sequence is the
        same pattern whatever its length): a section given would make it the user's fixed
        choice, which the level's self-measurement may not switch off."""
        if isinstance(config.get("grad_freeze"), dict):
            config["grad_freeze"].setdefault("total_steps", max(updates, 1))

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """A `GradientFreeze` of the configuration's `grad_freeze` parameters."""
        if validate or boost_config.features["grad_freeze"]:
            return GradientFreeze(**boost_config.params["grad_freeze"])
        return None

    def get_config(self):
        if isinstance(self.source, GradientFreeze):
            return {"GradientFreeze": self.source.get_config()}
        groups = [[v.path for v in branch.variables] for branch in self.plan.branches]
        return {"FreezeOpt": {"groups": groups, "strategy": [int(i) for i in self.plan.schedule]}}

    @classmethod
    def from_config(cls, config):
        if "GradientFreeze" in config:
            return cls(GradientFreeze.from_config(config["GradientFreeze"]))
        return cls(_SavedFreezeOpt(**config["FreezeOpt"]))

    def build(self, context):
        state, model, optimizer = context.state, context.model, context.optimizer
        self._model = weakref.ref(model)  # whether its step is compiled by XLA (`enter_branch`)
        freeze_opt = self.source
        if isinstance(freeze_opt, _SavedFreezeOpt):
            freeze_opt = freeze_opt.resolve(model, optimizer)
        if isinstance(freeze_opt, GradientFreeze):
            _, freeze_opt = freeze_opt.freeze_generate(model, optimizer)
        elif freeze_opt.optimizer is not optimizer:
            # The step applies every update with its own optimizer; a different one here
            # would be silently ignored, with its learning rate and state.
            raise ValueError(
                "The optimizer of `gradient_freeze` (a FreezeOpt) must be the optimizer the "
                f"model is compiled with: got {type(freeze_opt.optimizer).__name__} "
                f"{freeze_opt.optimizer.name!r}, but the model uses {type(optimizer).__name__} "
                f"{optimizer.name!r}. Pass the same instance to compile(optimizer=...)."
            )
        self.plan = freeze_cell(model, freeze_opt)
        self.position = state.add_state("freeze/position", 0, "int64")
        self.last_group = state.add_state("freeze/group", 0, "int32")
        removed = removed_batchnorms(model)
        if self.switch is not None and self.is_on() and not removed:
            self.switch_off()
            if distributed.rank() == 0:
                why = ("the level's LessBN is off" if removed is None
                       else "LessBN removed no BatchNormalization layer from this model")
                level = getattr(getattr(model, "auto_boost", None), "level", "the level")
                print(f"keras_boost: {level}'s {self.option} switched off: {why}, so nothing makes up "
                      "for the updates its frozen layers skip (alone, it cost keras-io's ConvMixer a median 0.9 pp of "
                      "test accuracy, docs/auto_boost.md); give the configuration's grad_freeze section, or "
                      "compile(gradient_freeze=True), to keep it.", flush=True)

    @property
    def group_indices(self):
        """Per group, the indices of its variables in `model.trainable_variables`."""
        return [list(branch.indices) for branch in self.plan.branches]

    def select_branch(self):
        if self.switch is not None and not self.is_on():
            # Switched off as the step was built (LessBN removed nothing): the step has no
            # freeze groups to choose from, so Keras' own train function runs it.
            return None
        return self.group_indices, self.current_group

    def after_update(self):
        self.advance()

    def upcoming_branch(self):
        """(group, updates): the group of the next update and how many updates in a row train it."""
        if self.plan is None:
            return None  # not built yet: the step's first call builds it
        schedule, period = self.plan.schedule, self.plan.period
        if not self.is_on():  # switched off by self-measurement: the full step, always
            return 0, period
        position = int(self.position.numpy()) % period
        group = int(schedule[position])
        updates = 1
        while updates < period and schedule[(position + updates) % period] == group:
            updates += 1
        return group, updates

    def branches_ahead(self):
        """The groups of one period of the sequence from where it stands, each once, in the order they come."""
        if not self.is_on():
            return []
        schedule = np.roll(np.asarray(self.plan.schedule), -(int(self.position.numpy()) % self.plan.period))
        _, first = np.unique(schedule, return_index=True)
        return [int(schedule[i]) for i in sorted(first)]

    def enter_branch(self, branch):
        """Inside the compiled step of group `branch`: checks the sequence agrees, records the group."""
        model = self._model() if getattr(self, "_model", None) else None
        if model is not None and model.jit_compile:  # XLA drops Assert ops (and says so, once per op)
            self.last_group.assign(tf.constant(branch, tf.int32))
            return
        expected = self._scheduled()
        check = tf.debugging.assert_equal(
            expected, tf.constant(branch, tf.int32),
            message=f"the compiled step of freeze group {branch} ran where the freeze sequence names another group")
        with tf.control_dependencies([check] if check is not None else []):
            self.last_group.assign(tf.constant(branch, tf.int32))

    def _scheduled(self):
        group = tf.gather(tf.constant(self.plan.schedule, tf.int32), self.position.value)
        return group if self.switch is None else tf.where(self.active(), group, 0)

    def current_group(self):
        group = self._scheduled()
        self.last_group.assign(group)
        return group

    def advance(self):
        following = (self.position.value + 1) % self.plan.period
        if self.switch is not None:  # switched off, the sequence stands still where it was
            following = tf.where(self.active(), following, self.position.value)
        self.position.assign(following)

    def shares(self):
        """{group: share of the steps that train it} over one period of the sequence."""
        if self.plan is None:
            return {}
        groups, counts = np.unique(np.asarray(self.plan.schedule), return_counts=True)
        return {int(g): float(c) / len(self.plan.schedule) for g, c in zip(groups, counts)}

    def verdict(self, times, alone):
        shares = self.shares()
        mean = sum(share * times[group] for group, share in shares.items())
        saving = 1.0 - mean / times[0]
        groups = ", ".join(f"{g}: {1000 * times[g]:.1f} ms" for g in sorted(shares) if g)
        return saving >= self.min_saving, (
            f"the freeze schedule's mean step takes {1000 * mean:.1f} ms against the full step's "
            f"{1000 * times[0]:.1f} ms ({100 * saving:+.1f}% saved; kept from {100 * self.min_saving:.0f}%; "
            f"groups {groups})")

    def gate_verdict(self, first, step, steps_left):
        """Whether the partial groups could pay back their compilation (each about as long as the
        full step's, `first - step`) in `steps_left`, saving at most `BACKWARD_SHARE` of a step on
        every partial step of the schedule (`keras_boost.step.tuning`'s gate)."""
        shares = self.shares()
        partial = sorted(g for g in shares if g != 0)
        saving = max(steps_left, 0) * (1.0 - shares.get(0, 0.0)) * BACKWARD_SHARE * step
        compiling = len(partial) * max(first - step, 0.0)
        return saving >= compiling, (
            f"its {len(partial)} partial groups would each compile about as long as the full step "
            f"({first - step:.2f} s: first step {first:.2f} s, then {1000 * step:.1f} ms), {compiling:.2f} s in all, "
            f"and the {steps_left} steps left of this fit could save at most {saving:.2f} s (the whole backward "
            "pass of every partial step)")

    log_keys = ("freeze_group",)

    def report_callbacks(self):
        self._counted = FrozenSteps()
        return [self._counted]

    def report(self, step):
        counted = getattr(self, "_counted", None)
        return {"frozen_step_share": round(counted.frozen / counted.steps, 3)} if counted and counted.steps else {}

    def logs(self):
        return {"freeze_group": self.last_group.value}


class _SavedFreezeOpt:
    """A FreezeOpt read back from a saved configuration: groups by variable path, resolved at build."""

    def __init__(self, groups, strategy):
        self.groups = groups
        self.strategy = strategy

    def resolve(self, model, optimizer):
        groups = resolve_paths(self.groups, model.trainable_variables, "the saved boost configuration")
        return FreezeOpt(optimizer, groups, self.strategy)


class FrozenSteps(keras.callbacks.Callback):
    """Counts the steps of `fit` that trained a partial freeze group (`freeze_group` > 0 in the step's logs).

    The freeze stage's `report_callbacks`; its `report` gives the share.

    What ran, not what the schedule says: a boost level's freezing may be switched off by
    its self-measurement (`keras_boost.step.tuning`) before or after its groups train.
    """

    def __init__(self):
        super().__init__()
        self.steps = self.frozen = 0

    def on_train_batch_end(self, batch, logs=None):
        if logs and "freeze_group" in logs:
            self.steps += 1
            self.frozen += int(np.asarray(logs["freeze_group"]) > 0)
