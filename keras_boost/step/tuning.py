"""Self-measurement: a boost level's stages that do not pay on this model and launch are switched off.

MindSpore's O1 switches gradient freezing and gradient centralization on for every model.
On a small network, or on several workers whose step is mostly communication, freezing's
partial steps save less than its machinery costs, and centralization is pure cost. So when
a boost level (not the user, by name or by a configuration section) switched a measurable
stage on, `SelfMeasurement` times the steps of `fit`:

- the steps of each branch (branch 0, the full step; with freezing, each partial group's
  step), leaving out each epoch's first step (it also starts the epoch's data) and each
  branch's first step (it traces the branch);
- each stage's own cost out of the step (`Stage.measure_alone`: centralization's pass over
  the kernels).

Once every branch has been timed often enough, the workers average their numbers (one small
allgather, at the same batch on every worker, so every worker takes the same decision), each
stage gives its verdict (`Stage.verdict`), and the stages that do not pay are switched off
between two steps: their switch variable goes to False, which the compiled steps read, so
nothing is retraced. One line per measured stage says what was decided and the numbers.

`BoostModel.fit` adds the callback; `keras_boost.config.BoostConfig.measured` says which
features it may switch off. It measures once per model (a second `fit` keeps the decision).
"""

import statistics
import time

import keras

from keras_boost import distributed


class SelfMeasurement(keras.callbacks.Callback):
    """Times the boost step's branches in `fit` and switches off the measured stages that do not pay.

    Args:
        stages: the step's stages to measure (each `measurable`, with a switch).
        full_steps: full steps to time before deciding (default 5).
        branch_steps: steps of each partial branch to time before deciding (default 3).
        verbose: print the decision lines on rank 0 (default True).

    After the decision, `decisions` is a list of `(stage option, kept, numbers)`.
    """

    def __init__(self, stages, full_steps=5, branch_steps=3, verbose=True):
        super().__init__()
        self.stages = list(stages)
        self.full_steps = full_steps
        self.branch_steps = branch_steps
        self.verbose = verbose
        self.decisions = None
        self.times = {}
        self._seen = set()
        self._start = None
        self._told = False

    @property
    def decided(self):
        return self.decisions is not None

    def _freeze(self):
        freeze = self.model.boost_step.freeze
        return freeze if freeze is not None and freeze.is_on() else None

    def _needed(self):
        """{branch: steps to time}: the full step, and each group the freeze schedule trains."""
        freeze = self._freeze()
        groups = {0, *freeze.shares()} if freeze is not None and freeze.plan is not None else {0}
        return {g: self.full_steps if g == 0 else self.branch_steps for g in groups}

    def on_epoch_begin(self, epoch, logs=None):
        self._first_of_epoch = True

    def on_train_batch_begin(self, batch, logs=None):
        self._start = None
        if self.decided:
            return
        freeze = self._freeze()
        first_of_epoch, self._first_of_epoch = self._first_of_epoch, False
        if freeze is not None and freeze.plan is None:
            return  # the step is built by its first call: the branch of this one is not known yet
        self._branch = freeze.upcoming_branch()[0] if freeze is not None else 0
        first_of_branch = self._branch not in self._seen
        self._seen.add(self._branch)
        if not (first_of_epoch or first_of_branch):
            self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._start is None:
            return
        self.times.setdefault(self._branch, []).append(time.perf_counter() - self._start)
        needed = self._needed()
        if all(len(self.times.get(b, ())) >= n for b, n in needed.items()):
            self._decide(sorted(needed))

    def on_train_end(self, logs=None):
        if not self.decided and not self._told and self.verbose and distributed.rank() == 0:
            self._told = True
            names = ", ".join(s.option for s in self.stages)
            timed = {b: len(t) for b, t in sorted(self.times.items())}
            verb = "stays" if len(self.stages) == 1 else "stay"
            print(f"keras_boost: the level's {names} {verb} on: this fit ran too few steps to time them (timed "
                  f"{timed} steps per branch, needed {self._needed()}); the next fit goes on timing", flush=True)

    def _decide(self, branches):
        local = {"times": {b: statistics.median(self.times[b]) for b in branches},
                 "alone": [stage.measure_alone() for stage in self.stages]}
        measured = distributed.allgather_object(local, "keras_boost_self_measurement") \
            if distributed.size() > 1 else [local]
        times = {b: statistics.fmean(m["times"][b] for m in measured) for b in branches}
        self.decisions = []
        for index, stage in enumerate(self.stages):
            alone = {k: statistics.fmean(m["alone"][index][k] for m in measured) for k in local["alone"][index]}
            pays, numbers = stage.verdict(times, alone)
            if not pays:
                stage.switch_off()
            self.decisions.append((stage.option, pays, numbers))
            if self.verbose and distributed.rank() == 0:
                where = f"on {distributed.size()} workers" if distributed.size() > 1 else "in one process"
                print(f"keras_boost: {self.model.auto_boost.level}'s {stage.option} "
                      f"{'stays on' if pays else 'switched off'} {where}: {numbers}", flush=True)
        object.__setattr__(self.model, "self_measurement", self.decisions)
