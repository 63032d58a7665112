"""One compiled train function per freeze group, chosen from Python between steps.

With gradient freezing the boost step has one branch per group. Tracing every branch into
one `tf.switch_case` makes the first step trace (and TensorFlow optimise) all of them, and
the step graph carries every branch's forward and backward pass. The freeze sequence is
known in advance and identical on every worker, so `fit` does not need to decide inside the
graph: `BranchTrainFunction` reads the sequence's position between steps, runs the group's
own compiled function, and compiles a group's function only when the group first trains.

It replaces `model.train_function` and keeps Keras' contract: each call consumes
`steps_per_execution` batches (fewer at the end of the data) from the epoch's iterator and
returns the last step's logs; an exhausted iterator raises as Keras' own function does.
With `steps_per_execution` > 1, consecutive steps of the same group run inside one compiled
call (a `tf.while_loop` over `steps`, traced once per group), so it still saves Python
round trips.

The first group's step is traced when `fit` first runs it; a background thread then traces
the other groups' steps, in the order the sequence reaches them, while the first steps
compile and run (tracing is Python, and TensorFlow's own compilation and the steps run
without holding Python's lock, so the two overlap). Keras keeps per-layer Python state
while a model is called (the `add_loss` lists, which every top-level call clears), so
two threads must not call one model at once: every trace of a group's step holds
`KERAS_LOCK`, and so do `BoostModel.__call__`, `test_step` and `predict_step`; the
background thread starts a trace only while `fit`'s main thread is inside a compiled
step. A group reached before its trace is done waits for it, as it would have traced it
itself; what is left of the tracing when `fit` ends is abandoned at the next group (the
next call traces ahead again). A trace that fails in the background is left to the
group's first step, which traces again and raises there. Once every group is traced, the
thread runs each group's function that has not run yet once on an empty iterator of the
data's type: no step runs, but TensorFlow optimises and sets up the graph then, not at
the group's first step.
The thread needs a core that the steps leave free: it runs where this process has at
least two cores per worker on its host (`os.sched_getaffinity`, Horovod's `local_size`).
Two workers on two cores have none to spare, and there tracing ahead made EfficientNetB0's
first epoch longer (docs/freeze.md). `KERAS_BOOST_TRACE_AHEAD`
says otherwise: `1` traces ahead always, `0` never (each group's step is traced when the
group first trains), `auto` (the default) by the rule above.
"""

import os
import threading

import tensorflow as tf

from keras_boost import _keras_compat

# Held while a BoostModel is traced or called outside its compiled train step (re-entrant).
KERAS_LOCK = threading.RLock()


class BranchTrainFunction:
    """`model.train_function` for a boost step with several branches (freeze groups).

    Args:
        model: the compiled `BoostModel`.
        jit_compile: whether each group's step is compiled with XLA (the model's resolved
            `jit_compile`, or False on many workers, as for the single-branch step).
        trace_ahead: trace the other groups' steps in a background thread once the first
            group's step is traced. None (the default) reads the environment variable
            `KERAS_BOOST_TRACE_AHEAD`: "auto" (the default: where each worker of this host
            has two cores or more, `spare_core`), "1" or "0".
    """

    def __init__(self, model, jit_compile, trace_ahead=None):
        self.model = model
        self.jit_compile = bool(jit_compile)
        self.trace_ahead = _trace_ahead_from_env() if trace_ahead is None else bool(trace_ahead)
        self._on_data = {}
        self._on_iterator = {}
        self._making = threading.RLock()  # one function per group, whichever thread asks first
        self._tracer = None  # the thread tracing the groups ahead
        self._ahead_started = False
        self._ahead_args = None  # (iterator spec, element spec, steps spec) of the first traced group
        self._stop = threading.Event()
        self._in_step = threading.Event()  # set while the main thread runs a compiled step
        self._traced = set()  # the groups whose `_steps_on_iterator` function is traced
        self._ran = set()  # the groups whose function has run on the epoch's data
        self.traced_ahead = []  # the groups whose step the background thread traced, in order
        self.set_up_ahead = []  # the groups whose step it also ran on an empty iterator (`_set_up`)
        self._empty = None  # that iterator (False: none of the data's type can be made)
        self._built = False
        self._fallback = None  # Keras' own train function, when the branches cannot be planned

    # ------------------------------------------------------------ compiled parts
    def _step_on_data(self, branch):
        """One step of `branch` on one batch (Keras' `one_step_on_data`), compiled once."""
        with self._making:
            return self._make_step_on_data(branch)

    def _make_step_on_data(self, branch):
        if branch not in self._on_data:
            model = self.model

            def one_step_on_data(data):
                return model.distribute_strategy.run(model.branch_train_step, args=(data, branch))

            if not model.run_eagerly:
                one_step_on_data = _quiet(tf.function(one_step_on_data, reduce_retracing=True,
                                                      jit_compile=self.jit_compile, autograph=False))
            self._on_data[branch] = _keras_compat.autoconvert_optionals(model, one_step_on_data)
        return self._on_data[branch]

    def _steps_on_iterator(self, branch):
        """Up to `steps` steps of `branch` from the iterator; returns (logs, steps run).

        Every batch is taken with `get_next_as_optional` and its step runs under a `tf.cond`
        on it, as in Keras' own multi-step function: a step whose batch is missing must not
        run at all (its freeze-position update does not depend on the data, so a failing
        `get_next` would not stop it). Without a batch it returns zeros and 0 steps.
        """
        if branch not in self._on_iterator:
            step = self._step_on_data(branch)

            def step_if(optional, previous):
                traced = {}

                def taken():
                    traced["logs"] = step(optional.get_value())
                    return traced["logs"]

                def not_taken():  # traced after `taken` (cond_v2 traces the true branch first)
                    if previous is not None:
                        return previous
                    return tf.nest.map_structure(
                        lambda t: tf.zeros([d if d is not None else 0 for d in t.shape], t.dtype), traced["logs"])

                return tf.cond(optional.has_value(), taken, not_taken)

            def run(iterator, steps):
                first = iterator.get_next_as_optional()
                outputs = step_if(first, None)

                def more(done, outputs, has_value):
                    return tf.logical_and(has_value, done < steps)

                def one_more(done, outputs, has_value):
                    following = iterator.get_next_as_optional()
                    outputs = step_if(following, outputs)
                    has_value = following.has_value()
                    return done + tf.cast(has_value, tf.int32), outputs, has_value

                done = tf.cast(first.has_value(), tf.int32)
                if self.model.steps_per_execution > 1:  # traced once per group; steps is a tensor
                    done, outputs, _ = tf.while_loop(more, one_more, (done, outputs, first.has_value()))
                return outputs, done

            if not self.model.run_eagerly:
                run = _quiet(tf.function(run, reduce_retracing=True, autograph=False))
            else:
                run = self._eager_run(step)
            self._on_iterator[branch] = run
        return self._on_iterator[branch]

    @staticmethod
    def _eager_run(step):
        def run(iterator, steps):
            outputs, done = None, 0
            while done < int(steps):
                optional = iterator.get_next_as_optional()
                if not optional.has_value():
                    break
                outputs, done = step(optional.get_value()), done + 1
            return outputs, done

        return run

    def traced_groups(self):
        """The groups whose step has been compiled so far, in the order they first trained."""
        return list(self._on_data)

    def tracing_counts(self):
        """{(kind, group): times traced} of every compiled function (each should be traced once)."""
        counts = {}
        for kind, functions in (("step", self._on_data), ("steps", self._on_iterator)):
            for group, function in functions.items():
                if not hasattr(function, "experimental_get_tracing_count"):
                    function = getattr(function, "__wrapped__", function)  # under Keras' optional wrapper
                if hasattr(function, "experimental_get_tracing_count"):
                    counts[(kind, group)] = function.experimental_get_tracing_count()
        return counts

    # ----------------------------------------------------------------- the call
    def __call__(self, iterator):
        model = self.model
        step = model.boost_step
        limit = model.steps_per_execution
        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            outputs = None  # a Python iterator of batches (train_on_batch): one batch at a time
            for _, data in zip(range(limit), iterator):
                self._build(data)
                if self._fallback is not None:
                    return self._fallback(iter([data]))
                outputs = self._step_on_data(step.next_branch(1)[0])(data)
            return outputs
        self._build(iterator.element_spec)
        if self._fallback is not None:
            return self._fallback(iterator)
        self._start_tracing_ahead()  # where a first fit's gate held it back
        outputs, remaining = None, limit
        while remaining > 0:
            branch, steps = step.next_branch(remaining)
            function = self._steps_on_iterator(branch)
            if branch not in self._traced and not model.run_eagerly:
                self._trace_here(function, iterator, branch)
            self._in_step.set()
            try:
                logs, done = function(iterator, tf.constant(steps, tf.int32))
            finally:
                self._in_step.clear()
            self._ran.add(branch)
            done = int(done)
            if done:
                outputs = logs
            remaining -= done
            if done < steps:  # the data ended inside the run
                break
        if outputs is None:
            raise StopIteration  # nothing left at all: Keras ends the epoch
        return outputs

    # ------------------------------------------------------- tracing ahead
    def _trace_here(self, function, iterator, branch):
        """Traces `branch`'s step in this thread; after the first, starts tracing the groups ahead."""
        steps = tf.TensorSpec([], tf.int32)
        spec = getattr(iterator, "_type_spec", None) or iterator
        with KERAS_LOCK:  # waits for a trace of the background thread
            function.get_concrete_function(spec, steps)
            self._traced.add(branch)
        self._ahead_args = (spec, getattr(iterator, "element_spec", None), steps)
        self._start_tracing_ahead()

    def _start_tracing_ahead(self):
        """Starts the background thread on the groups still to come, once a first group is traced.

        Not while the selecting stage is switched off (held back by self-measurement's gate,
        `keras_boost.step.tuning`): a later call starts it if the stage is switched on again.
        """
        if self._ahead_started or not self.trace_ahead or self._ahead_args is None:
            return
        selecting = self.model.boost_step._with("select_branch")[0]
        if not selecting.is_on():
            return
        self._ahead_started = True
        ahead = [b for b in self.model.boost_step.branches_ahead() if b not in self._traced]
        if not ahead:
            return
        spec, element_spec, steps = self._ahead_args
        self._stop.clear()
        self._tracer = threading.Thread(target=self._trace_ahead,
                                        args=(ahead, spec, element_spec, steps, _keras_compat.thread_settings()),
                                        daemon=True, name="keras_boost-trace-groups")
        self._tracer.start()

    def _trace_ahead(self, branches, spec, element_spec, steps, settings):
        # Keras keeps the global dtype policy and random seed per thread: this one traces with fit's.
        _keras_compat.adopt_thread_settings(settings)
        # Every trace first (Python, which only this thread can do while fit's thread runs
        # steps), then the set-ups (TensorFlow's own work, without Python's lock: fit's thread
        # sets up a group it reaches first itself, on the other core).
        for branch in branches:
            while not self._in_step.wait(0.05):  # a trace starts while the main thread runs a step
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                return
            with KERAS_LOCK:
                if branch in self._traced:  # the main thread got there first
                    continue
                try:
                    with self.model.distribute_strategy.scope():  # as Keras' fit traces (thread-local too)
                        self._steps_on_iterator(branch).get_concrete_function(spec, steps)
                except Exception:  # noqa: BLE001 - the group's first step traces again and raises there
                    return
                self._traced.add(branch)
            self.traced_ahead.append(branch)
        for branch in branches:
            if self._stop.is_set():
                return
            if branch in self._ran or branch not in self._traced:
                continue
            try:
                self._set_up(branch, spec, element_spec)
            except Exception:  # noqa: BLE001 - the group's first step sets it up, and raises there
                return

    def _set_up(self, branch, spec, element_spec):
        """Runs `branch`'s traced function once on an empty iterator of the same type.

        No step runs (without a batch the step's `tf.cond` is not taken: no variable, no
        collective, no freeze position is touched), but TensorFlow optimises and sets up the
        whole graph on this first call, which the group's first real step then does not.
        """
        empty = self._empty_iterator(spec, element_spec)
        if empty is None:
            return
        self._steps_on_iterator(branch)(empty, tf.constant(1, tf.int32))
        self.set_up_ahead.append(branch)

    def _empty_iterator(self, spec, element_spec):
        """An iterator of `spec`'s type (elements of `element_spec`) that yields nothing, or None for a type it
        cannot make."""
        if self._empty is None:
            empty = False
            if element_spec is not None:
                try:
                    dataset = tf.data.Dataset.from_generator(lambda: iter(()), output_signature=element_spec)
                    iterator = iter(dataset)
                    if iterator._type_spec == spec:
                        empty = iterator
                except (TypeError, ValueError):  # a type from_generator cannot produce
                    pass
            self._empty = empty
        return self._empty or None

    def finish_tracing(self):
        """Stops tracing ahead at the next group and waits for the current one (`fit` calls it at its end)."""
        tracer, self._tracer = self._tracer, None
        self._ahead_args = None  # the next fit's data may be another type: its first trace sets them again
        if tracer is None:
            return
        self._stop.set()
        tracer.join()
        self._ahead_started = False  # the next call traces what is still ahead

    def _build(self, data_or_spec):
        """Builds the model and the boost step before the first step (the groups come from the variables)."""
        if self._built:
            return
        model = self.model
        if not model.boost_step.built:
            if not all(layer.built for layer in _keras_compat.flatten_layers(model)):
                _keras_compat.symbolic_build(model, _keras_compat.symbolic_batch(data_or_spec))
            model.boost_step.build(model.boost_state)
        self._built = True
        if not model.boost_step.plans_branches():
            # One group after all, or a selecting stage that cannot say its branches ahead.
            from keras_boost.fit.dropin import without_jit_for_collectives

            with without_jit_for_collectives(model):
                self._fallback = _keras_compat.make_keras_train_function(model, model.train_step)


def _trace_ahead_from_env():
    value = os.environ.get("KERAS_BOOST_TRACE_AHEAD", "auto").strip()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"KERAS_BOOST_TRACE_AHEAD must be 'auto' (trace the freeze groups' steps in the background "
                         f"where a core is free for it, the default), '1' (always) or '0' (never: each when its "
                         f"group first trains), got {value!r}")
    return spare_core() if value == "auto" else value == "1"


def spare_core():
    """Whether this process has a core its steps leave free: two or more per worker on this host."""
    from keras_boost import distributed

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2 * max(1, distributed.local_size())


def _quiet(function):
    """Keeps TensorFlow's "frequent retracing" warning off these functions.

    TensorFlow counts traces per Python code object, so the groups' functions, one each,
    traced once each, would read as one function retraced once per group. (A private
    attribute of `tf.function`, present since TF 2.4; without it the warning is only noise.)
    """
    if hasattr(function, "_omit_frequent_tracing_warning"):
        function._omit_frequent_tracing_warning = True
    return function
