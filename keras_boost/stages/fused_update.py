"""The fused update: the optimizer's update through TensorFlow's fused training kernels.

`BoostModel.compile(fused_update=True)`, and the boost levels O1 and O2, apply Keras'
`SGD`, `Adam` and `AdamW` updates with one TensorFlow kernel per variable instead of
Keras 3's separate tensor ops (`m * momentum`, `g * lr`, their difference, the assign, the
assign-add: each a pass over the variable): `ResourceApplyKerasMomentum` (`m = momentum *
m - lr * g; w += m`, Nesterov too), `ResourceApplyGradientDescent` (`w -= lr * g`) and
`ResourceApplyAdam` (Keras' Adam formula, `alpha = lr * sqrt(1 - beta_2^t) / (1 -
beta_1^t)`), the kernels tf.keras used before Keras 3. MindSpore's optimizers are such
kernels (`ApplyMomentum`, `Adam`): one kernel per variable instead of several element-wise
ops (what it saves: docs/fused_update.md).

It is an `around_update` stage: the optimizer's `update_step` is the kernel form while
the step's `apply_update` runs (the default's `optimizer.apply`, or AdaSum's local step).
Everything else of `optimizer.apply` stays Keras' own: learning-rate schedules,
`iterations`, clipping, weight decay (AdamW), EMA, Keras' gradient accumulation. Sparse
gradients (`tf.IndexedSlices`, from `Embedding`) and variables whose dtype the kernels do
not take keep Keras' update. The results equal Keras' up to float rounding (one kernel
instead of several ops).
"""

import contextlib

import keras
import tensorflow as tf

from keras_boost import _warnings
from keras_boost._validation import check_bool
from keras_boost.core.adapter import applying_optimizer
from keras_boost.core.contract import Stage


class FusedUpdate(Stage):
    """Applies the optimizer's update with TensorFlow's fused kernels (SGD, Adam, AdamW).

    Args:
        strict: True (`compile(fused_update=True)`): an optimizer without a fused kernel is
            a `ValueError` at `compile`. False (a boost level's): such an optimizer keeps
            Keras' update, with one warning.
    """

    option = "fused_update"
    option_help = ("True: Keras' SGD, Adam and AdamW updates through TensorFlow's fused kernels, one per variable "
                   '(on at O1/O2).')
    on_with_true = True

    def report(self, step):
        return {"fused_update": why_not_fused(step.optimizer) is None}

    def __init__(self, strict=True):
        self.strict = check_bool("strict", strict)

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """On at a level that switches any feature on, unless `"boost": {"fused_update": False}`."""
        return cls(strict=False) if boost_config.fused_update and not validate else None

    def check_optimizer(self, optimizer):
        reason = why_not_fused(optimizer)
        if reason is None:
            return
        if self.strict:
            raise ValueError(f"`fused_update=True`, but {reason}; pass fused_update=False, or use "
                             "keras.optimizers.SGD, Adam or AdamW (without amsgrad).")
        _warnings.warn(f"keras_boost: the boost level's fused update is off: {reason}; Keras' update is used.",
                       UserWarning)

    def around_update(self, optimizer):
        return fused_kernels(optimizer)

    def get_config(self):
        return {"strict": self.strict}


_KERNEL_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def why_not_fused(optimizer):
    """None when `optimizer`'s update has a fused kernel here; otherwise a sentence saying why not."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return f"{type(optimizer).__name__} is not a keras.optimizers.Optimizer"
    optimizer = applying_optimizer(optimizer)
    kind = type(optimizer)
    if "update_step" in vars(optimizer):
        return f"this {kind.__name__} has an update_step of its own"
    if kind.update_step is keras.optimizers.SGD.update_step:
        return None
    if kind.update_step is keras.optimizers.Adam.update_step:
        if optimizer.amsgrad:
            return f"{kind.__name__} with amsgrad=True has no fused kernel here"
        return None
    return (f"{kind.__name__}'s update has no fused kernel here (keras.optimizers.SGD, Adam and AdamW have, "
            "and subclasses that keep their update_step)")


@contextlib.contextmanager
def fused_kernels(optimizer):
    """While inside, `optimizer.apply` updates with TensorFlow's fused kernels (traced graph or eager).

    An optimizer without a fused form (`why_not_fused`) is left as it is. The swap is an
    instance attribute, removed on exit, so the optimizer is Keras' own again afterwards.
    """
    if why_not_fused(optimizer) is not None:
        yield optimizer
        return
    optimizer = applying_optimizer(optimizer)
    keras_step = type(optimizer).update_step
    kernel = _sgd_kernel if keras_step is keras.optimizers.SGD.update_step else _adam_kernel

    def update_step(gradient, variable, learning_rate):
        if isinstance(gradient, tf.IndexedSlices) or not _kernel_variable(variable):
            return keras_step(optimizer, gradient, variable, learning_rate)
        return kernel(optimizer, gradient, variable, learning_rate)

    optimizer.update_step = update_step
    try:
        yield optimizer
    finally:
        del optimizer.update_step


def _kernel_variable(variable):
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return (isinstance(value, tf.Variable) and hasattr(value, "handle") and value.handle.dtype == tf.resource
            and value.dtype in _KERNEL_DTYPES)


def _handle(variable):
    return (variable.value if isinstance(variable, keras.Variable) else variable).handle


def _sgd_kernel(optimizer, gradient, variable, learning_rate):
    dtype = variable.dtype
    lr = tf.cast(learning_rate, dtype)
    gradient = tf.cast(gradient, dtype)
    if optimizer.momentum != 0:
        m = optimizer.momentums[optimizer._get_variable_index(variable)]
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=_handle(variable), accum=_handle(m), lr=lr, grad=gradient,
            momentum=tf.cast(optimizer.momentum, dtype), use_locking=False, use_nesterov=bool(optimizer.nesterov))
    return tf.raw_ops.ResourceApplyGradientDescent(var=_handle(variable), alpha=lr, delta=gradient, use_locking=False)


def _adam_kernel(optimizer, gradient, variable, learning_rate):
    dtype = variable.dtype
    lr = tf.cast(learning_rate, dtype)
    gradient = tf.cast(gradient, dtype)
    local_step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1 = tf.cast(optimizer.beta_1, dtype)
    beta_2 = tf.cast(optimizer.beta_2, dtype)
    index = optimizer._get_variable_index(variable)
    return tf.raw_ops.ResourceApplyAdam(
        var=_handle(variable), m=_handle(optimizer._momentums[index]), v=_handle(optimizer._velocities[index]),
        beta1_power=tf.pow(beta_1, local_step), beta2_power=tf.pow(beta_2, local_step), lr=lr,
        beta1=beta_1, beta2=beta_2, epsilon=tf.cast(optimizer.epsilon, dtype), grad=gradient,
        use_locking=False, use_nesterov=False)
