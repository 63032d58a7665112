"""BoostModel: a keras.Model whose train_step runs the boost step across Horovod workers."""

import contextlib
import sys

import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_boost import distributed, _keras_compat, _warnings
from keras_boost._keras_compat import Functional, Trainer, functional_init_arguments
from keras_boost._validation import alias
from keras_boost.config import BoostConfig
from keras_boost.step import registry
from keras_boost.step.loop import BoostStep
from keras_boost.core.state import BoostState


@keras.saving.register_keras_serializable(package="keras_boost")
class BoostModel(_keras_compat.BoostLogsMixin, keras.Model):
    """A `keras.Model` trained by the boost step, with gradients averaged across Horovod workers.

    Build it like any Keras model, functionally (`BoostModel(inputs, outputs)`) or by
    subclassing, then `compile` it with the boost options and `fit` it. Under `horovodrun`
    or `mpirun` every worker runs the same script on its own shard of the data; gradients
    are averaged across workers in one grouped allreduce per update, all variables are broadcast from rank
    0 when `fit` starts, the epoch logs of `fit` and `evaluate` are averaged across
    workers, and the progress bar is shown on rank 0 only.

    Boost options of `compile` (all off by default; at a boost level, False switches off
    the level's stage of that option):
        sens: scale of the loss gradient (MindSpore's `sens`), default 1.0.
        stages: more `keras_boost.step.Stage` objects to run in the step.
        **kwargs: Keras' own compile arguments, and every registered stage's option
            (`keras_boost.step.registry.options()`, those registered with
            `keras_boost.step.registry.register` included); keras_boost's own:
{options}

    Boost levels (`BoostModel(inputs, outputs, boost_level="O1", boost_config=...)`;
    MindSpore's `boost_config_dict=` is accepted as an alias of `boost_config`):
        the level's model rewrites (`registry.rewrites()`) are applied to the graph when the
        model is built, and its stages are switched on by `compile` (explicit compile
        options win). See `keras_boost.AutoBoost`.

    Example:
        >>> inputs = keras.Input((28, 28, 1))
        >>> outputs = keras.layers.Dense(10)(keras.layers.Flatten()(inputs))
        >>> model = keras_boost.BoostModel(inputs, outputs, boost_level="O1")
        >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        >>> model.fit(x, y, batch_size=32)
    """

    def __new__(cls, *args, **kwargs):
        # Keras makes a functional subclass by rewriting the class's bases for good, which
        # would break every later subclass of BoostModel; use a functional variant instead.
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            cls = _functional_variant(cls)
        return super().__new__(cls)

    def __init__(self, *args, boost_level=None, boost_config=None, boost_config_dict=None, **kwargs):
        boost_config = alias("boost_config", boost_config, "boost_config_dict", boost_config_dict)
        auto_boost = None
        if boost_level is not None or boost_config is not None:
            auto_boost = BoostConfig(boost_level or "O0", boost_config)
            registry.validate_level(auto_boost)
        if isinstance(self, Functional):
            Trainer.__init__(self)
            args, kwargs, rewritten = _rewritten_graph(auto_boost, args, kwargs)
            Functional.__init__(self, *args, **kwargs)
        else:
            for rewrite in registry.rewrites():
                if rewrite.applies(auto_boost):
                    raise rewrite.subclassed_error(self, auto_boost)
            super().__init__(*args, **kwargs)
            rewritten = {}
        for rewrite in registry.rewrites():  # what each rewrite did, under its attribute (None: not run)
            rewrite.adopt(self, rewritten.get(rewrite))
        # Boost state is training state, like optimizer slots: kept out of Keras' layer
        # tracking (so weights, get_weights and count_params equal keras.Model's), yet saved
        # by Keras' saving (which walks the attributes) and by tf.train.Checkpoint (the edge).
        object.__setattr__(self, "boost_state", BoostState())
        _keras_compat.track_for_checkpoint(self, self.boost_state, "boost_state")
        self.boost_step = None
        self.auto_boost = auto_boost
        object.__setattr__(self, "self_measurement", None)

    # --------------------------------------------------------------- compile
    def compile(self, optimizer="rmsprop", loss=None, *, sens=1.0, gradient_split_groups=None, stages=(), **kwargs):
        from keras_boost.fit.dropin import make_distributed_optimizer

        # The boost options are the registered stages' options (`registry.options()`); the rest is Keras'.
        given = {option: kwargs.pop(option) for option in registry.options() if option in kwargs}
        given["gradient_split_groups"] = gradient_split_groups
        optimizer = registry.unwrap_optimizer(optimizer, given)  # an optimizer adapter becomes its stage
        from_level = set()
        if self.auto_boost is not None:  # the level's stages, unless given explicitly
            covered = getattr(optimizer, "boost_option", None)  # an optimizer adapter that stays the optimizer
            for name, value in registry.level_options(self.auto_boost).items():
                if name != covered and given.get(name) is None:
                    given[name] = value
                    from_level.add(name)
        for rewrite in registry.rewrites():
            rewrite.check_compile(self, loss)
        kwargs["auto_scale_loss"] = False  # the boost step owns loss scaling
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        make_distributed_optimizer(self.optimizer)  # a user train_step's apply averages across workers
        self.boost_step = BoostStep(self, self.optimizer, sens=sens, stages=stages, **given)
        object.__setattr__(self, "self_measurement", None)  # decisions of step/tuning.py, untracked
        object.__setattr__(self, "_measuring", None)  # a new step: its stages are timed afresh
        for stage in self.boost_step.stages:  # the level's stages that fit may switch off (step/tuning.py)
            if stage.measurable and stage.option in from_level and self.auto_boost.measured(stage.level_section):
                stage.add_switch()
        if self.built:
            self.boost_step.build(self.boost_state)

    # ---------------------------------------------------------------- saving
    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Keras' `save`; on several workers the file is written whole (`dropin.write_whole`)."""
        from keras_boost.fit import dropin

        if not overwrite or zipped is False:  # Keras' prompt reads the target; a folder is not one file
            return super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        return dropin.write_whole(filepath, lambda path: keras.Model.save(self, path, overwrite=True, zipped=zipped,
                                                                          **kwargs))

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Keras' `save_weights`; on several workers the file is written whole (`dropin.write_whole`)."""
        from keras_boost.fit import dropin

        if not overwrite or max_shard_size is not None:  # the prompt; sharded weights are several files
            return super().save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)
        return dropin.write_whole(filepath, lambda path: keras.Model.save_weights(self, path, overwrite=True))

    def get_config(self):
        config = super().get_config()
        if self.auto_boost is not None:
            config["auto_boost"] = self.auto_boost.get_config()
        names = getattr(self, "output_names", None)
        if isinstance(self, Functional) and names and names != [_output_layer(t).name for t in self.outputs]:
            config["output_names"] = list(names)  # a rewrite ended an output in a layer of its own
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        auto_boost = config.pop("auto_boost", None)
        output_names = config.pop("output_names", None)
        model = super().from_config(config, custom_objects=custom_objects)  # the graph is already rewritten
        if output_names is not None:
            model.output_names = list(output_names)
        if auto_boost is not None:
            model.auto_boost = BoostConfig(**auto_boost)
        return model

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is not None and self.boost_step is not None:
            config["boost"] = registry.step_config(self.boost_step)
        return config

    def compile_from_config(self, config):
        # Keras skips compile for models that override it; BoostModel restores its boost
        # options (and so the boost state variables) along with Keras' own.
        config = dict(config)
        boost = config.pop("boost", {})
        config = keras.saving.deserialize_keras_object(config)
        optimizer = config.pop("optimizer", "rmsprop")
        self.compile(optimizer=optimizer, **config, **registry.options_from_config(boost))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    # ----------------------------------------------------------------- steps
    # The steps of a stage's branches may be traced in a background thread (`step/dispatch.py`);
    # Keras' per-layer call state (the `add_loss` lists) allows one caller at a time.
    def __call__(self, *args, **kwargs):
        from keras_boost.step.dispatch import KERAS_LOCK

        with KERAS_LOCK:
            return super().__call__(*args, **kwargs)

    def test_step(self, data):
        from keras_boost.step.dispatch import KERAS_LOCK

        with KERAS_LOCK:
            return super().test_step(data)

    def predict_step(self, data):
        from keras_boost.step.dispatch import KERAS_LOCK

        with KERAS_LOCK:
            return super().predict_step(data)

    def train_step(self, data):
        return self.branch_train_step(data, None)

    def branch_train_step(self, data, branch):
        """The boost step of branch `branch` (a Python int), or of the step's own choice (None)."""
        if self.boost_step is None:
            raise RuntimeError("BoostModel must be compiled before training; call model.compile(...)")
        if not self.boost_step.built and not all(layer.built for layer in _keras_compat.flatten_layers(self)):
            # The TensorFlow trainer defers building subclassed models to the first trace;
            # the boost step needs the variables first.
            _keras_compat.symbolic_build(self, data)
        self.boost_step.build(self.boost_state)
        return self.boost_step.train_step(data, branch)

    def make_train_function(self, force=False):
        from keras_boost.fit.dropin import without_jit_for_collectives
        from keras_boost.step.dispatch import BranchTrainFunction

        if self.train_function is not None and not force:
            return self.train_function
        with without_jit_for_collectives(self):
            if self._chooses_branches_in_python():
                # One compiled function per branch, each traced when the branch first trains.
                self.train_function = BranchTrainFunction(self, self.jit_compile)
                return self.train_function
            return super().make_train_function(force=force)

    def _chooses_branches_in_python(self):
        step = self.boost_step
        if step is None or type(self).train_step is not BoostModel.train_step or not step._with("select_branch"):
            return False  # no branches, or a user train_step that Keras' own function runs
        return not step.built or step.plans_branches()

    # ------------------------------------------------------ worker agreement
    def fit(self, *args, callbacks=None, verbose="auto", **kwargs):
        try:
            return self._fit(*args, callbacks=callbacks, verbose=verbose, **kwargs)
        finally:
            from keras_boost.step.dispatch import BranchTrainFunction

            if isinstance(getattr(self, "train_function", None), BranchTrainFunction):
                self.train_function.finish_tracing()  # the branches' steps traced in the background

    def _fit(self, *args, callbacks=None, verbose="auto", **kwargs):
        from keras_boost.fit import dropin
        from keras_boost.fit.callbacks import (AverageBatchNormStatistics, BroadcastGlobalVariablesCallback,
                                               StopTogether)
        from keras_boost.fit.elastic import elastic_launch

        callbacks = list(callbacks or [])
        if self.boost_step is not None:
            callbacks[:0] = [c for stage in self.boost_step.stages for c in stage.fit_callbacks()]
        measurement = self._self_measurement()
        if measurement is not None:
            callbacks.insert(0, measurement)
        if distributed.size() > 1 and not any(isinstance(c, BroadcastGlobalVariablesCallback) for c in callbacks):
            callbacks.insert(0, BroadcastGlobalVariablesCallback(root_rank=0))
        if distributed.size() > 1 and not elastic_launch() and \
                not any(isinstance(c, AverageBatchNormStatistics) for c in callbacks):
            callbacks.insert(0, AverageBatchNormStatistics())  # first at each epoch's end: checkpoints see it
        callbacks, verbose = dropin.progress_callbacks(self, callbacks, _rank_zero_verbose(verbose))
        kwargs, args = _fit_arguments(args, kwargs), ()
        if "shuffle" not in kwargs and isinstance(kwargs.get("x"), tf.data.Dataset):
            kwargs["shuffle"] = False  # Keras ignores it for a Dataset, and warns when it is True (its default)
        if distributed.size() > 1:
            # One collective before the first one of fit: same configuration everywhere
            # (ValueError otherwise), and the same number of steps per epoch (uneven data).
            from keras_boost.fit import data_sync, watchdog

            guard = watchdog.StallWatchdog()
            callbacks.insert(0, guard)
            if not elastic_launch():  # every worker stops after the same batch (an elastic job re-forms instead)
                together = StopTogether()
                callbacks.append(together)  # after the user's: it decides once they have all asked
                self.__dict__["_stop_together"] = together
            guard.start()
            try:
                kwargs = data_sync.prepare_fit(self, kwargs, callbacks)
                history = super().fit(callbacks=callbacks, verbose=verbose,
                                      **_keras_compat.without_epoch_stalls(kwargs))
                self._after_fit(kwargs)
                return history
            except tf.errors.OpError as error:
                if not _abandoned(error) or distributed.elastic_launch():
                    raise
                lines = watchdog.abandoned_lines(distributed.rank(), distributed.size(), guard.seconds_still())
                print("\n".join(lines), file=sys.stderr, flush=True)
                raise RuntimeError(lines[0]) from error
            finally:
                guard.stop()
                together = self.__dict__.pop("_stop_together", None)
                if together is not None:
                    self.__dict__["_stop_training"] = together.decision()
        history = super().fit(callbacks=callbacks, verbose=verbose, **_keras_compat.without_epoch_stalls(kwargs))
        self._after_fit(kwargs)
        return history

    def _after_fit(self, kwargs):
        """The stages' work once fit has returned (`Stage.after_fit`), on every worker; `kwargs`: the
        data as fit got it (arrays are batched again in their order, not shuffled)."""
        for stage in self.boost_step.stages if self.boost_step is not None else ():
            if stage.overrides("after_fit"):
                stage.after_fit(self, lambda: _keras_compat.training_batches(kwargs))

    @property
    def stop_training(self):
        """Keras' flag; in a fit on several workers, the workers' common decision (`callbacks.StopTogether`)."""
        together = self.__dict__.get("_stop_together")
        return together.decision() if together is not None else self.__dict__.get("_stop_training", False)

    @stop_training.setter
    def stop_training(self, value):
        together = self.__dict__.get("_stop_together")
        if together is not None:
            together.request(value)
        else:
            self.__dict__["_stop_training"] = value

    def _self_measurement(self):
        """The callback that times the level's measured stages in this fit, or None (`step/tuning.py`)."""
        from keras_boost.step.tuning import SelfMeasurement

        step = self.boost_step
        if step is None or self.self_measurement is not None:
            return None  # nothing compiled, or measured by an earlier fit: the decision stands
        ongoing = self.__dict__.get("_measuring")
        if ongoing is not None:
            return ongoing  # an earlier fit ended before it could decide: the timing goes on
        stages = [s for s in step.stages if s.switch is not None and s.is_on()]
        if not stages:
            return None
        from keras_boost.fit.elastic import elastic_launch

        why = None
        if self.steps_per_execution > 1:
            why = f"steps_per_execution={self.steps_per_execution} runs several steps per call"
        elif type(self).train_step is not BoostModel.train_step:
            why = "the model overrides train_step"
        elif elastic_launch():  # a worker that joins later would not share the timing, nor the decision
            why = "elastic training: workers that join later must run the same step"
        if why is not None:
            if distributed.rank() == 0:
                verb = "stays" if len(stages) == 1 else "stay"
                print(f"keras_boost: {self.auto_boost.level}'s {', '.join(s.option for s in stages)} {verb} on "
                      f"unmeasured: {why}", flush=True)
            object.__setattr__(self, "self_measurement", [])
            return None
        object.__setattr__(self, "_measuring", SelfMeasurement(stages))
        return self._measuring

    def evaluate(self, *args, verbose="auto", callbacks=None, across_workers=None, **kwargs):
        """Keras' `evaluate`; on several workers, whose data the metrics cover depends on the caller.

        In `fit` (validation), every worker's: the metric states of all workers are summed, so
        that every worker's callbacks see the same `val_` numbers. Called by a script, this
        worker's own, with no collective, as Horovod's Keras `evaluate` is: rank 0 evaluating
        alone (`if rank == 0: model.evaluate(...)`, then a barrier, a save or another fit)
        neither waits for the others nor makes them wait. `across_workers=True`, called on
        every worker, sums the metric states of all of them (every sample weighs the same
        when the workers hold different numbers); `CollectiveMismatch` at once where another
        worker reached a different call that needs every worker.
        """
        from keras_boost.fit import dropin

        in_fit = bool(kwargs.get("_use_cached_eval_dataset", False))
        if across_workers is None:
            across_workers = in_fit
        elif not isinstance(across_workers, bool):
            raise TypeError(f"across_workers must be True, False or None (None: True inside fit's validation, False "
                            f"otherwise), got {across_workers!r} of type {type(across_workers).__name__}")
        if across_workers and not in_fit and distributed.size() > 1:
            distributed.rendezvous("BoostModel.evaluate(across_workers=True)")
        callbacks, verbose = dropin.progress_callbacks(self, callbacks, _rank_zero_verbose(verbose))
        with self._metrics_of_this_worker(not across_workers):
            return super().evaluate(*args, verbose=verbose, callbacks=callbacks, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        """Keras' `test_on_batch`: this worker's own metrics, with no collective (as `evaluate()`)."""
        with self._metrics_of_this_worker(True):
            return super().test_on_batch(*args, **kwargs)

    @contextlib.contextmanager
    def _metrics_of_this_worker(self, local):
        previous = self.__dict__.get("_local_metrics", False)
        self.__dict__["_local_metrics"] = local
        try:
            yield
        finally:
            self.__dict__["_local_metrics"] = previous

    def get_metrics_result(self):
        """The metric results, averaged across workers when called between steps (in fit, and in
        `evaluate(across_workers=True)`); this worker's own in `evaluate()` and `test_on_batch`.

        When the other workers have already finished (`evaluate(across_workers=True)` on one
        rank at the end of a script), this worker's own results, with one warning.
        """
        from keras_boost.fit import dropin

        results = super().get_metrics_result()
        if tf.inside_function() or distributed.size() == 1 or not results or self.__dict__.get("_local_metrics"):
            return results
        # The workers' metric states are summed, so every sample weighs the same even when
        # the workers evaluated different numbers of samples (uneven data); once the others
        # have finished (rank-0-only evaluate), this worker's own results.
        from keras_boost.fit import data_sync

        try:
            results = data_sync.metrics_result(self, super().get_metrics_result)
        except tf.errors.OpError as error:
            return dropin.alone_results(results, error)
        return {n: float(keras.ops.convert_to_numpy(v)) if np.ndim(v) == 0 else v for n, v in results.items()}

    def extra_log_keys(self):
        # The step's logs carry boost scalars besides the metrics (see BoostLogsMixin).
        return set(self.boost_step.logs()) if self.boost_step is not None and self.boost_step.built else set()


def _abandoned(error):
    """Whether a collective failed because the job came apart (Horovod shut down, Gloo's peer gone)."""
    text = str(error)
    return any(mark in text for mark in ("Horovod has been shut down", "Timed out waiting", "Connection closed by peer",
                                         "Connection reset by peer"))


def _rewritten_graph(auto_boost, args, kwargs):
    """The functional (inputs, outputs) after the level's model rewrites, and {rewrite: the model it made}."""
    rewrites = [rewrite for rewrite in registry.rewrites() if rewrite.applies(auto_boost)]
    if not rewrites:
        return args, kwargs, {}
    kwargs = dict(kwargs)
    inputs = kwargs.pop("inputs") if "inputs" in kwargs else args[0]
    outputs = kwargs.pop("outputs") if "outputs" in kwargs else args[1]
    # named as the user will know it (a rewrite's warnings name the model), not Keras' 'functional_4'
    model = keras.Model(inputs, outputs, name=kwargs.get("name") or "BoostModel")
    made = {}
    for rewrite in rewrites:
        with warnings.catch_warnings(record=True) as caught:  # shown at the user's BoostModel(...)
            warnings.simplefilter("always")
            model = made[rewrite] = rewrite.rewrite(model, auto_boost)
        for caught_warning in caught:
            _warnings.warn(caught_warning.message, caught_warning.category)
    inputs, outputs = _keras_compat.functional_structure(model)  # the user's dict or list, not flattened
    return (inputs, outputs, *args[2:]), kwargs, made


def _output_layer(tensor):
    return _keras_compat.inbound_node(tensor).operation


BoostModel.__doc__ = BoostModel.__doc__.replace("{options}", registry.describe_options(" " * 12))
_FUNCTIONAL_VARIANTS = {}


def _functional_variant(cls):
    """`cls` with `Functional` mixed in (made once per class)."""
    if cls not in _FUNCTIONAL_VARIANTS:
        variant = type(cls.__name__, (cls, Functional), {"__module__": cls.__module__})
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:  # saved files name the variant as the user registered the class
            package, name = registered.split(">", 1)
            keras.saving.register_keras_serializable(package=package, name=name)(variant)
        _FUNCTIONAL_VARIANTS[cls] = variant
    return _FUNCTIONAL_VARIANTS[cls]


def _fit_arguments(args, kwargs):
    """fit's positional and keyword arguments as one dict of keyword arguments."""
    import inspect

    names = [n for n in inspect.signature(keras.Model.fit).parameters if n != "self"][:4]
    if len(args) > len(names):
        raise TypeError(f"BoostModel.fit takes x, y, batch_size and epochs positionally, the rest by keyword; "
                        f"got {len(args)} positional arguments")
    arguments = dict(zip(names, args))
    for name, value in kwargs.items():
        if name in arguments:
            raise TypeError(f"fit got multiple values for argument {name!r}")
        arguments[name] = value
    return arguments


def _rank_zero_verbose(verbose):
    return verbose if distributed.rank() == 0 else 0
