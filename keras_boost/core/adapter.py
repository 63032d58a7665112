"""The optimizer adapter: a Keras optimizer that stands for a stage and lets another optimizer apply.

`FreezeOpt` (gradient freezing) and `optimizers.CentralizedOptimizer` are MindSpore's and
keras-io's optimizer forms of two stages. Both wrap the user's optimizer, which keeps the
learning rate, the iterations and the slots; this base holds that delegation once.
`registry.unwrap_optimizer` reads `boost_option` and `unwraps_into_step` to turn an adapter
given to `compile` into its stage.
"""

import keras


class OptimizerAdapter(keras.optimizers.Optimizer):
    """A `keras.optimizers.Optimizer` whose `inner_optimizer` applies the updates.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` that applies every update.
        name: the adapter's name.
        argument: how the subclass names `inner_optimizer` in its errors (MindSpore's
            `FreezeOpt(opt, ...)` calls it `opt`).
        **kwargs: only `learning_rate` (Keras' `from_config` passes it), which stays the
            inner optimizer's; anything else is a `ValueError`.

    Class attributes:
        boost_option: the `compile` option of the stage this adapter stands for.
        boost_option_what: what that option holds, for the error when both are given.
        unwraps_into_step: whether the boost step runs the stage and lets the inner
            optimizer apply (True), or keeps the adapter as its optimizer (False).
    """

    boost_option = None
    boost_option_what = None
    unwraps_into_step = False

    def __init__(self, inner_optimizer, name=None, argument="inner_optimizer", **kwargs):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"`{argument}` must be a keras.optimizers.Optimizer instance, got "
                            f"{type(inner_optimizer).__name__}.")
        unknown = sorted(k for k in kwargs if k != "learning_rate")
        if unknown:
            raise ValueError(f"{type(self).__name__} takes no optimizer arguments of its own, got {unknown}; set "
                             "them on the optimizer it wraps")
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer

    @property
    def optimizer(self):
        return self.inner_optimizer

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)


def applying_optimizer(optimizer):
    """The optimizer whose `update_step` runs: through keras_boost's optimizer adapters and
    Keras' `LossScaleOptimizer`, which hand their updates to `inner_optimizer`."""
    while isinstance(optimizer, (OptimizerAdapter, keras.optimizers.LossScaleOptimizer)):
        optimizer = optimizer.inner_optimizer
    return optimizer


def keras_loss_scale_optimizer(optimizer):
    """Keras' `LossScaleOptimizer` among `optimizer` and the optimizers keras_boost's adapters wrap, or None."""
    while isinstance(optimizer, OptimizerAdapter):
        optimizer = optimizer.inner_optimizer
    return optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
