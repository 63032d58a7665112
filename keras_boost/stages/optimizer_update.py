"""The optimizer's update: the default `apply_update` of the boost step.

`optimizer.apply(grads, variables)`, as `keras.Model.train_step` does. The registry makes
this stage when no other stage owns `apply_update` (AdaSum does: a local step, then the
weight deltas combined across groups).
"""

from keras_boost.core.contract import Stage


class OptimizerUpdate(Stage):
    """Applies the gradients with the step's Keras optimizer (the step's default `apply_update`)."""

    option = "optimizer_update"
    default_for = "apply_update"

    @classmethod
    def from_option(cls, value, model):
        return cls()

    def apply_update(self, optimizer, grads, variables):
        optimizer.apply(grads, variables)
