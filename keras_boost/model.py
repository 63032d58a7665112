"""BoostModel: a keras.Model whose train_step runs the boost step across Horovod workers."""

import keras
import tensorflow as tf
from keras.src.models.functional import Functional
from keras.src.models.model import Trainer, functional_init_arguments

from keras_boost import distributed
from keras_boost.loss_scale import DynamicLossScale, LossScale, as_loss_scale
from keras_boost.state import BoostState
from keras_boost.step import BoostTrainOneStep


def _loss_scale_option(loss_scale):
    """`compile(loss_scale=...)`: None/"auto", "dynamic", a number, a tensor or a stage."""
    if loss_scale is None or (isinstance(loss_scale, str) and loss_scale == "auto"):
        policy = keras.config.dtype_policy().name
        return DynamicLossScale() if policy == "mixed_float16" else None
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return DynamicLossScale()
        raise ValueError(f"loss_scale must be None, 'auto', 'dynamic', a number, a scalar tensor or a "
                         f"LossScale, got {loss_scale!r}")
    if isinstance(loss_scale, LossScale):
        return loss_scale
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return as_loss_scale(tf.constant(float(loss_scale)), name="loss_scale")
    return as_loss_scale(loss_scale, name="loss_scale")


@keras.saving.register_keras_serializable(package="keras_boost")
class BoostModel(keras.Model):
    """A `keras.Model` trained by the boost step, with gradients averaged across Horovod workers.

    Build it like any Keras model, functionally (`BoostModel(inputs, outputs)`) or by
    subclassing, then `compile` it with the boost options and `fit` it. Under `horovodrun`
    or `mpirun` every worker runs the same script on its own shard of the data; gradients
    are averaged in one fused allreduce per update, all variables are broadcast from rank
    0 when `fit` starts, the epoch logs of `fit` and `evaluate` are averaged across
    workers, and the progress bar is shown on rank 0 only.

    Boost options of `compile` (all off by default):
        sens: scale of the loss gradient (the seed's `sens`), default 1.0.
        loss_scale: None or "auto" (dynamic scaling under the `mixed_float16` policy,
            none otherwise), "dynamic", a number or scalar tensor (fixed), or a
            `DynamicLossScale` / `FixedLossScale`.
        gradient_accumulation: micro-batches per update (int) or a `GradientAccumulation`.
        gradient_freeze: a `GradientFreeze` (turned into groups of this model) or a `FreezeOpt`.
        gradient_centralization: True or "mindspore" (MindSpore's rule: conv/dense kernels
            whose input channels are a multiple of 16), "all" (the keras-io recipe: every
            gradient of rank 2 or more), or a `GradientCentralization`.
        adasum: True, or an `AdaSum` stage.
        nan_guard: without loss scaling, stop `fit` with `FloatingPointError` at the first
            update whose averaged gradient is not finite, before it reaches the weights
            (default True; False applies it anyway, like plain Keras).
        gradient_split_groups: None (one fused allreduce per update) or increasing indices
            into `trainable_variables` at which to start a new fused allreduce (the seed's
            `gradient_split_groups` / `ParameterProcess` fusion groups).

    Boost levels (`BoostModel(inputs, outputs, boost_level="O1", boost_config=...)`):
        the level's LessBN rewrite is applied to the graph when the model is built, and
        its other stages are switched on by `compile` (explicit compile options win).
        See `keras_boost.AutoBoost`.

    Example:
        >>> inputs = keras.Input((28, 28, 1))
        >>> outputs = keras.layers.Dense(10)(keras.layers.Flatten()(inputs))
        >>> model = keras_boost.BoostModel(inputs, outputs)
        >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy",
        ...               gradient_accumulation=4)
        >>> model.fit(x, y, batch_size=32)
    """

    def __new__(cls, *args, **kwargs):
        # Keras makes a functional subclass by rewriting the class's bases for good, which
        # would break every later subclass of BoostModel; use a functional variant instead.
        if functional_init_arguments(args, kwargs) and not issubclass(cls, Functional):
            cls = _functional_variant(cls)
        return super().__new__(cls)

    def __init__(self, *args, boost_level=None, boost_config=None, **kwargs):
        auto_boost = None
        if boost_level is not None or boost_config is not None:
            from keras_boost.auto_boost import AutoBoost

            auto_boost = AutoBoost(boost_level or "O0", boost_config)
        if isinstance(self, Functional):
            Trainer.__init__(self)
            args, kwargs, report = _rewritten_graph(auto_boost, args, kwargs)
            Functional.__init__(self, *args, **kwargs)
            self.less_bn_report = report
        elif auto_boost is not None and auto_boost.enabled("less_bn"):
            raise TypeError("boost levels with LessBN rewrite the layer graph: build the BoostModel functionally "
                            "(BoostModel(inputs, outputs, boost_level=...)), or use boost_level only at compile "
                            "with less_bn switched off")
        else:
            super().__init__(*args, **kwargs)
        # Boost state is training state, like optimizer slots: kept out of Keras' layer
        # tracking (so weights, get_weights and count_params equal keras.Model's), yet saved
        # by Keras' saving (which walks the attributes) and by tf.train.Checkpoint (the edge).
        object.__setattr__(self, "boost_state", BoostState())
        self._track_trackable(self.boost_state, name="boost_state")
        self.boost_step = None
        self.auto_boost = auto_boost

    # --------------------------------------------------------------- compile
    def compile(self, optimizer="rmsprop", loss=None, *, sens=1.0, loss_scale=None, gradient_accumulation=None,
                gradient_freeze=None, gradient_centralization=None, adasum=None, gradient_split_groups=None,
                nan_guard=True, **kwargs):
        from keras_boost import stages

        from keras_boost.dropin import make_distributed_optimizer

        kwargs["auto_scale_loss"] = False  # the boost step owns loss scaling
        super().compile(optimizer=optimizer, loss=loss, **kwargs)
        make_distributed_optimizer(self.optimizer)  # a user train_step's apply averages across workers
        given = {"gradient_accumulation": gradient_accumulation, "gradient_freeze": gradient_freeze,
                 "gradient_centralization": gradient_centralization, "adasum": adasum,
                 "gradient_split_groups": gradient_split_groups}
        if self.auto_boost is not None:  # the level's stages, unless given explicitly
            for name, value in self.auto_boost.compile_options(self).items():
                given[name] = value if given[name] is None else given[name]
        self.boost_step = BoostTrainOneStep(
            self,
            self.optimizer,
            sens=sens,
            loss_scale=_loss_scale_option(loss_scale),
            gradient_accumulation=stages.accumulation_option(given["gradient_accumulation"]),
            gradient_freeze=stages.freeze_option(given["gradient_freeze"]),
            gradient_centralization=stages.centralization_option(given["gradient_centralization"], self),
            adasum=stages.adasum_option(given["adasum"]),
            gradient_split_groups=given["gradient_split_groups"],
            nan_guard=nan_guard,
        )
        if self.built:
            self.boost_step.build(self.boost_state)

    # ---------------------------------------------------------------- saving
    def get_config(self):
        config = super().get_config()
        if self.auto_boost is not None:
            config["auto_boost"] = self.auto_boost.get_config()
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        auto_boost = config.pop("auto_boost", None)
        model = super().from_config(config, custom_objects=custom_objects)  # the graph is already rewritten
        if auto_boost is not None:
            from keras_boost.auto_boost import AutoBoost

            model.auto_boost = AutoBoost(**auto_boost)
        return model

    def get_compile_config(self):
        config = super().get_compile_config()
        if config is not None and self.boost_step is not None:
            from keras_boost import stages

            config["boost"] = stages.step_config(self.boost_step)
        return config

    def compile_from_config(self, config):
        # Keras skips compile for models that override it; BoostModel restores its boost
        # options (and so the boost state variables) along with Keras' own.
        from keras_boost import stages

        config = dict(config)
        boost = config.pop("boost", {})
        config = keras.saving.deserialize_keras_object(config)
        optimizer = config.pop("optimizer", "rmsprop")
        self.compile(optimizer=optimizer, **config,
                     **stages.options_from_config(boost, self, keras.optimizers.get(optimizer)))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    # ----------------------------------------------------------------- steps
    def train_step(self, data):
        if self.boost_step is None:
            raise RuntimeError("BoostModel must be compiled before training; call model.compile(...)")
        graph = tf.compat.v1.get_default_graph()
        if tf.inside_function() and not getattr(graph, "_keras_boost_names_restarted", False):
            graph._keras_boost_names_restarted = True  # once per trace, even with steps_per_execution > 1
            distributed.reset_collective_names()
        if not self.boost_step.built and not all(layer.built for layer in self._flatten_layers()):
            # The TensorFlow trainer defers building subclassed models to the first trace;
            # the boost step needs the variables first.
            self._symbolic_build(data_batch=data)
        self.boost_step.build(self.boost_state)
        return self.boost_step(data)

    def make_train_function(self, force=False):
        from keras_boost.dropin import without_jit_for_collectives

        with without_jit_for_collectives(self):
            return super().make_train_function(force=force)

    # ------------------------------------------------------ worker agreement
    def fit(self, *args, callbacks=None, verbose="auto", **kwargs):
        from keras_boost import dropin
        from keras_boost.callbacks import BroadcastGlobalVariablesCallback

        from keras_boost.callbacks import NonFiniteGuard

        callbacks = list(callbacks or [])
        if self.boost_step is not None and self.boost_step.nan_guard and self.boost_step.loss_scale is None:
            callbacks.insert(0, NonFiniteGuard())
        if distributed.size() > 1 and not any(isinstance(c, BroadcastGlobalVariablesCallback) for c in callbacks):
            callbacks.insert(0, BroadcastGlobalVariablesCallback(root_rank=0))
        callbacks, verbose = dropin.progress_callbacks(self, callbacks, _rank_zero_verbose(verbose))
        return super().fit(*args, callbacks=callbacks, verbose=verbose, **kwargs)

    def evaluate(self, *args, verbose="auto", callbacks=None, **kwargs):
        from keras_boost import dropin

        callbacks, verbose = dropin.progress_callbacks(self, callbacks, _rank_zero_verbose(verbose))
        return super().evaluate(*args, verbose=verbose, callbacks=callbacks, **kwargs)

    def get_metrics_result(self):
        """The metric results, averaged across workers when called between steps.

        When the other workers have already finished (the `if rank == 0: model.evaluate(...)`
        idiom at the end of a script), this worker's own results, with one warning.
        """
        from keras_boost import dropin

        results = super().get_metrics_result()
        if tf.inside_function() or distributed.size() == 1 or not results:
            return results
        return dropin.average_over_participants(results)

    def _get_metrics_result_or_logs(self, logs):
        # The step's logs carry boost scalars besides the metrics; Keras only swaps in the
        # (worker-averaged) metric results when the keys match, so split them off first.
        boost_keys = set(self.boost_step.logs()) if self.boost_step is not None and self.boost_step.built else set()
        if not isinstance(logs, dict) or not boost_keys & set(logs):
            return super()._get_metrics_result_or_logs(logs)
        metrics = {k: v for k, v in logs.items() if k not in boost_keys}
        result = dict(super()._get_metrics_result_or_logs(metrics))
        result.update({k: v for k, v in logs.items() if k in boost_keys})
        return result


def _rewritten_graph(auto_boost, args, kwargs):
    """The functional (inputs, outputs) after the level's LessBN rewrite, and its report."""
    if auto_boost is None or not auto_boost.enabled("less_bn"):
        return args, kwargs, None
    from keras_boost.less_bn import LessBN

    kwargs = dict(kwargs)
    inputs = kwargs.pop("inputs") if "inputs" in kwargs else args[0]
    outputs = kwargs.pop("outputs") if "outputs" in kwargs else args[1]
    rewritten = LessBN(keras.Model(inputs, outputs), fn_flag=auto_boost.params["less_bn"]["fn_flag"])
    return (rewritten.inputs, rewritten.outputs, *args[2:]), kwargs, rewritten.less_bn_report


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


def _rank_zero_verbose(verbose):
    return verbose if distributed.rank() == 0 else 0
