"""Gradient centralization for any Keras optimizer: a thin adapter over the stage.

`CentralizedOptimizer(optimizer)` wraps any Keras optimizer, as
`keras.optimizers.LossScaleOptimizer` does: every gradient it receives goes through a
`keras_boost.GradientCentralization` stage (the one class, rule and defaults that the boost
step uses) before the inner optimizer applies it. Keras 3 calls `apply` (through
`apply_gradients` or `fit`), never the `get_gradients` that the keras-io example overrides,
so this works where that example's optimizer silently does nothing.
"""

import keras

from keras_boost.core.adapter import OptimizerAdapter
from keras_boost.core.contract import StepContext
from keras_boost.stages.centralization import GradientCentralization


@keras.saving.register_keras_serializable(package="keras_boost")
class CentralizedOptimizer(OptimizerAdapter):
    """An optimizer that centralizes the gradients, then lets `inner_optimizer` apply them.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` that applies the update.
        centralization: a `keras_boost.GradientCentralization` stage: which gradients are
            centred. None (default): the stage's defaults, MindSpore's rule: gradients of
            rank 2 or more whose input-channel size (`shape[-2]`, Keras' `(..., in, out)`
            layout) is a multiple of 16, among the variables the optimizer is built on.
            keras-io's recipe (every gradient of rank 2 or more):
            `GradientCentralization.every_kernel()`; some variables only:
            `GradientCentralization(variables, min_channels_multiple)`.
        name: the optimizer's name.

    The learning rate, iterations and slots are the inner optimizer's. The wrapper has
    no state of its own; saving and `.keras` files round-trip it.

    Example:
        >>> optimizer = keras_boost.optimizers.CentralizedOptimizer(
        ...     keras.optimizers.Adam(1e-3), keras_boost.GradientCentralization.every_kernel())
        >>> model = keras.Model(inputs, outputs)
        >>> model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    """

    # A boost level's gradient centralization is not added on top of it (it centralises
    # already); the step keeps it as the optimizer (`registry.unwrap_optimizer`).
    boost_option = "gradient_centralization"
    unwraps_into_step = False

    def __init__(self, inner_optimizer, centralization=None, name=None, **kwargs):
        super().__init__(inner_optimizer, name=name, **kwargs)
        if centralization is None:
            centralization = GradientCentralization()
        if not isinstance(centralization, GradientCentralization):
            raise TypeError(f"`centralization` must be a keras_boost.GradientCentralization or None, got "
                            f"{centralization!r} of type {type(centralization).__name__}.")
        self.centralization = centralization

    def build(self, var_list):
        super().build(var_list)
        if not self.centralization.resolved:
            self.centralization.build(StepContext(None, self, list(var_list), None))

    def applies_to(self, variable):
        """Whether the gradient of `variable` gets centred."""
        return self.centralization.applies_to(variable)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        self.inner_optimizer.apply(self.centralization.apply(list(grads), trainable_variables), trainable_variables)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        own = len(self._variables)
        grads = self.centralization.apply(list(grads), list(trainable_variables))
        new_trainable, new_inner = self.inner_optimizer.stateless_apply(
            optimizer_variables[own:], grads, trainable_variables)
        return new_trainable, list(optimizer_variables[:own]) + list(new_inner)

    def get_config(self):
        return {"name": self.name, "centralization": self.centralization.get_config(),
                "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        centralization = GradientCentralization.from_config(config.pop("centralization"))
        return cls(inner, centralization, **config)
