"""Self-measurement: a boost level's stages that do not pay on this model and launch are switched off.

A boost level switches stages on for every model, as MindSpore's O1 does. On a small
network, or on several workers whose step is mostly communication, some of them cost more
than they save. So when a boost level (not the user, by name or by a configuration section)
switched a measurable stage on (`Stage.measurable`), `SelfMeasurement` times the steps of
`fit`:

- the steps of each branch (branch 0, the full step; with a `select_branch` stage, each
  partial branch's step), leaving out each epoch's first step (it also starts the epoch's
  data) and each branch's first step (it traces the branch);
- each stage's own cost out of the step (`Stage.measure_alone`).

Before the partial branches are compiled, a gate asks the branching stage whether they could
pay back their compilation in this `fit` at all (`Stage.gate_verdict`): each branch's step is
compiled when it first trains, or ahead in a background thread (`keras_boost.step.dispatch`),
and either way that work competes with the steps. So when the fit's length is known, the
branching stage waits for the first `gate_steps` steps (full steps; its sequence stands
still; nothing is traced ahead), which time the first step (it compiles the full step) and
the steps after it; then its `gate_verdict` decides from those times and the steps left. A
stage that cannot pay is switched off for this model with one line and its numbers. In a fit
of unknown length (a `tf.data` pipeline without a cardinality, a generator) the gate holds
the branches back for the whole first epoch, which gives the epoch's length (the same on
every worker: uneven data ends every worker's epoch at the same step), and decides at its
end. A fit that ends inside the gate leaves the stage as configured, and the next fit gates
again, its compilation estimate taken from the earlier fit's first step.

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
        gate_steps: full steps the gate times before the partial branches compile (default 3:
            the first, which compiles, and two more). `SelfMeasurement.gate = False` turns
            the gate off (the tests of the timing itself do).
        verbose: print the decision lines on rank 0 (default True).

    After the decision, `decisions` is a list of `(stage option, kept, numbers)`.
    """

    gate = True  # the gate before the partial branches compile (see the module's text)

    def __init__(self, stages, full_steps=5, branch_steps=3, verbose=True, gate_steps=3):
        super().__init__()
        self.stages = list(stages)
        self.full_steps = full_steps
        self.branch_steps = branch_steps
        if not isinstance(gate_steps, int) or gate_steps < 2:
            raise ValueError(f"gate_steps must be an int >= 2 (the first step and at least one after it), "
                             f"got {gate_steps!r}")
        self.gate_steps = gate_steps
        self.verbose = verbose
        self.decisions = None
        self.times = {}
        self._seen = set()
        self._start = None
        self._told = False
        self._gate = None  # the times of the gate's steps while it holds the branches back
        self._gated = None  # the branching stage's decision at the gate, when it switched it off
        self._gate_passed = False
        self._epoch_steps = None  # the fit's steps per epoch, once known
        self._epoch_start = 0
        self._first_step = 0.0  # the first step of an earlier fit that ended inside the gate

    @property
    def decided(self):
        return self.decisions is not None

    def _branching(self):
        """The stage that chooses each step's branch (`select_branch`), while it is on; else None."""
        selecting = self.model.boost_step.branching()
        return selecting if selecting is not None and selecting.is_on() else None

    def _needed(self):
        """{branch: steps to time}: the full step, and each branch the selecting stage trains."""
        selecting = self._branching()
        groups = {0, *selecting.shares()} if selecting is not None else {0}
        return {g: self.full_steps if g == 0 else self.branch_steps for g in groups}

    def on_train_begin(self, logs=None):
        self._first_epoch = None
        self._steps_run = 0
        selecting = self._branching()
        if not self.gate or self.decided or self._gate_passed or selecting is None or selecting not in self.stages:
            return
        self._gate_passed = True  # one gate per model: a later fit goes on from the decision
        self._epoch_steps = self.params.get("steps") if self.params else None  # None: learnt at the first epoch's end
        if not self._at_boundary():
            return  # a fit that starts inside a window (a resumed one) keeps its branch
        selecting.switch_off()  # held back: full steps while the gate times them
        self._gate = []

    def on_epoch_begin(self, epoch, logs=None):
        self._first_of_epoch = True
        if self._first_epoch is None:
            self._first_epoch = epoch
        self._epoch_start = self._steps_run

    def on_epoch_end(self, epoch, logs=None):
        if self._gate is not None and self._epoch_steps is None:  # a fit of unknown length: now it is known
            self._epoch_steps = self._steps_run - self._epoch_start
            if epoch + 1 < self.params["epochs"]:  # after the fit's last epoch, on_train_end leaves it to the next fit
                self._try_closing_gate()

    def on_train_batch_begin(self, batch, logs=None):
        self._start = None
        if self._gate is not None:
            self._start = time.perf_counter()
            self._first_of_epoch = False
            return
        if self.decided:
            return
        selecting = self._branching()
        first_of_epoch, self._first_of_epoch = self._first_of_epoch, False
        upcoming = selecting.upcoming_branch() if selecting is not None else (0, 1)
        if upcoming is None:
            return  # the step is built by its first call: the branch of this one is not known yet
        self._branch = upcoming[0]
        first_of_branch = self._branch not in self._seen
        self._seen.add(self._branch)
        if not (first_of_epoch or first_of_branch):
            self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._steps_run += 1  # counted when run: with data of unknown length, the epoch's last begin runs no step
        if self._start is None:
            return
        if self._gate is not None:
            self._gate.append(time.perf_counter() - self._start)
            self._try_closing_gate()
            return
        self.times.setdefault(self._branch, []).append(time.perf_counter() - self._start)
        needed = self._needed()
        if all(len(self.times.get(b, ())) >= n for b, n in needed.items()) and self._at_boundary():
            self._decide(sorted(needed))

    def _at_boundary(self):
        """Whether no window of updates is open (`window` owners): a switch changes the branch only
        between windows (a window trains one branch; its sums are read and reset by branch)."""
        return self.model.boost_step.at_window_boundary()

    def _try_closing_gate(self):
        """Closes the gate once it has timed enough steps, knows the fit's length and no window is open."""
        if len(self._gate) >= self.gate_steps and self._epoch_steps is not None and self._at_boundary():
            self._close_gate()

    def on_train_end(self, logs=None):
        if self._gate is not None:  # the fit ended inside the gate: the stage as configured, the next fit gates
            if self._gate:  # its first step compiled the full step; the next fit's first step will not
                self._first_step = max(self._first_step, self._gate[0])
            self._gate = None
            self._gate_passed = False
            self.model.boost_step.branching().switch.assign(True)
        if not self.decided and not self._told and self.verbose and distributed.rank() == 0:
            self._told = True
            names = ", ".join(s.option for s in self.stages)
            timed = {b: len(t) for b, t in sorted(self.times.items())}
            verb = "stays" if len(self.stages) == 1 else "stay"
            print(f"keras_boost: the level's {names} {verb} on: this fit ran too few steps to time them (timed "
                  f"{timed} steps per branch, needed {self._needed()}); the next fit goes on timing", flush=True)

    def _close_gate(self):
        """Whether the selecting stage's branches could pay back their compilation in what is left of this fit."""
        gate, self._gate = self._gate, None
        # the same count on every worker; the first step that compiled may have been an earlier fit's
        local = {"first": max(gate[0], self._first_step), "step": statistics.median(gate[1:])}
        measured = _every_worker(local, "keras_boost_branch_gate")
        first = statistics.fmean(m["first"] for m in measured)
        step = statistics.fmean(m["step"] for m in measured)
        self.times.setdefault(0, []).extend(gate[1:])  # full steps, after the one that compiled
        self._seen.add(0)
        selecting = self.model.boost_step.branching()
        left = (self.params["epochs"] - (self._first_epoch or 0)) * self._epoch_steps - self._steps_run
        pays, numbers = selecting.gate_verdict(first, step, left)
        if pays:
            selecting.switch.assign(True)
            return
        self._gated = (selecting.option, False, numbers)
        self.stages.remove(selecting)
        if self.verbose and distributed.rank() == 0:
            print(f"keras_boost: {self.model.auto_boost.level}'s {selecting.option} switched off "
                  f"{self._where()} before compiling its groups: {numbers}", flush=True)
        if not self.stages:
            self.decisions = [self._gated]
            object.__setattr__(self.model, "self_measurement", self.decisions)

    @staticmethod
    def _where():
        return f"on {distributed.size()} workers" if distributed.size() > 1 else "in one process"

    def _decide(self, branches):
        local = {"times": {b: statistics.median(self.times[b]) for b in branches},
                 "alone": [stage.measure_alone() for stage in self.stages]}
        measured = _every_worker(local, "keras_boost_self_measurement")
        times = {b: statistics.fmean(m["times"][b] for m in measured) for b in branches}
        self.decisions = [self._gated] if self._gated is not None else []
        for index, stage in enumerate(self.stages):
            alone = {k: statistics.fmean(m["alone"][index][k] for m in measured) for k in local["alone"][index]}
            pays, numbers = stage.verdict(times, alone)
            if not pays:
                stage.switch_off()
            self.decisions.append((stage.option, pays, numbers))
            if self.verbose and distributed.rank() == 0:
                print(f"keras_boost: {self.model.auto_boost.level}'s {stage.option} "
                      f"{'stays on' if pays else 'switched off'} {self._where()}: {numbers}", flush=True)
        object.__setattr__(self.model, "self_measurement", self.decisions)


def _every_worker(local, name):
    """`local` of every worker, in rank order (one allgather; this process's alone without Horovod workers)."""
    return distributed.allgather_object(local, name) if distributed.size() > 1 else [local]
