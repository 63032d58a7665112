"""The fused BatchNorm: Keras' `BatchNormalization` trained through TensorFlow's fused kernel.

Keras 3 trains a `BatchNormalization` layer with separate tensor ops: the moments (a mean,
a squared difference, a second mean), then the normalisation (a rsqrt, two multiplies, an
add), and autodiff's dozen ops for their gradient. TensorFlow has one kernel for the
forward pass (`FusedBatchNormV3`, oneDNN's on CPUs where TensorFlow turns it on, cuDNN's on
GPUs) and one for its gradient: tf.keras 2 used them (`fused=True`), Keras 3 does not.
`BoostModel.compile(fused_batchnorm=True)`, and the boost levels O1 and O2, run each such
layer's training forward pass through that kernel while the boost step's forward pass runs.

It is an `around_forward` stage: while the step's forward pass is traced, the model's
`BatchNormalization` layers answer `call(..., training=True)` with the fused kernel; the
swap is an instance attribute, removed on exit, so `evaluate`, `predict`, a plain
`keras.Model` sharing the layers and everything outside the step see Keras' layer. The
layers keep their class, config, variables and weights; saving is unchanged.

What the layer computes is Keras' formula: the batch mean and biased variance, `(x - mean) *
rsqrt(variance + epsilon) * gamma + beta`, and the moving statistics `moving * momentum +
batch * (1 - momentum)` with the biased variance (the kernel returns the unbiased one,
which is converted back). The results equal Keras' up to float rounding (one kernel sums in
another order). Layers the kernel does not fit keep Keras' call: a mask, `renorm`,
`synchronized`, an axis other than the last, inputs of rank below 2 or in float64,
variables not in float32, `epsilon` below 1.001e-5 (cuDNN's floor), and subclasses that
override `call`.

A step compiled by XLA (`jit_compile`) keeps Keras' call for every layer. XLA has no fused
kernel to call: it expands `FusedBatchNormV3` into its own operations, and computes the
batch variance there in one pass, as the mean of the squares less the square of the mean.
In float32 that cancels where a channel's mean is large against its spread (a channel of
mean 3 and spread 1e-3 gets a negative variance), and the error compounds over the updates.
Keras' call takes the variance in two passes (the mean of the squared differences), and XLA
fuses its operations itself.
"""

import contextlib

import keras
import tensorflow as tf

from keras_boost import _keras_compat
from keras_boost.core.contract import Stage
from keras_boost.stages import swap

_MIN_EPSILON = 1.001e-5  # TensorFlow's floor for the fused kernel (cuDNN's CUDNN_BN_MIN_EPSILON, with a margin)


class FusedBatchNorm(Stage):
    """Trains the model's `BatchNormalization` layers through TensorFlow's fused kernel.

    No arguments and no state. `layers` (after `build`) lists the layers that take the
    fused kernel in a step not compiled by XLA; `not_fused` maps the names of the others to
    why not.
    """

    option = "fused_batchnorm"
    option_help = ("True: the BatchNormalization layers' training forward pass through TensorFlow's fused kernel (on"
                   ' at O1/O2).')
    on_with_true = True

    def report(self, step):
        return {"fused_batchnorm": f"{len(self.layers)} of {len(self.layers) + len(self.not_fused)}"}

    def __init__(self):
        self.layers, self.not_fused = [], {}

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """On at a level that switches any feature on, unless `"boost": {"fused_batchnorm": False}`."""
        return cls() if boost_config.fused_batchnorm and not validate else None

    def build(self, context):
        self.layers, self.not_fused = [], {}
        for layer in _keras_compat.flatten_layers(context.model):
            if not isinstance(layer, keras.layers.BatchNormalization):
                continue
            reason = why_not_fused(layer)
            if reason is None:
                self.layers.append(layer)
            else:
                self.not_fused[layer.name] = reason

    def around_forward(self, model):
        if model.jit_compile:  # resolved when the step is traced: False where fit runs the step without XLA
            return contextlib.nullcontext()
        return fused_calls(self.layers)


def why_not_fused(layer):
    """None when `layer` (a built `BatchNormalization`) can train through the fused kernel; else why not."""
    if type(layer).call is not keras.layers.BatchNormalization.call:
        return f"{type(layer).__name__} overrides call"
    if not layer.built:
        return "not built"
    if layer.renorm:
        return "renorm=True"
    if layer.synchronized:
        return "synchronized=True"
    if layer.epsilon < _MIN_EPSILON:
        return f"epsilon={layer.epsilon} is below the fused kernel's {_MIN_EPSILON}"
    if layer.moving_mean.dtype != "float32":
        return f"its variables are {layer.moving_mean.dtype}"
    return None


def fused_calls(layers):
    """While inside, each of `layers` trains through the fused kernel (eager or traced).

    Reentrant and thread-safe (`keras_boost.stages.swap`): freeze groups traced ahead in a
    background thread enter it while the main thread may be inside too.
    """
    return swap.swapped(layers, lambda layer: "call", _fused_call)


def _fused_call(layer):
    keras_call = type(layer).call.__get__(layer)

    def call(inputs, training=None, mask=None):
        if training is not True or not layer.trainable or mask is not None:
            return keras_call(inputs, training=training, mask=mask)
        rank = len(inputs.shape)
        if rank < 2 or layer.axis not in (-1, rank - 1) or inputs.dtype == tf.float64:
            return keras_call(inputs, training=training, mask=mask)
        return fused_batch_norm(layer, inputs)

    return call


def fused_batch_norm(layer, inputs):
    """Keras' `BatchNormalization` training call on channels-last `inputs`, through `FusedBatchNormV3`."""
    x = tf.cast(inputs, tf.float32)  # as Keras: half-precision inputs are normalised in float32
    channels = x.shape[-1]
    shape = tf.shape(x)
    if len(x.shape) != 4:  # the kernel takes NHWC: every axis but the channels' becomes N, H or W
        x = tf.reshape(x, tf.stack([shape[0], -1, 1, channels]))
    # the variables are float32 (`why_not_fused`)
    scale = tf.convert_to_tensor(layer.gamma) if layer.scale else tf.ones([channels], tf.float32)
    offset = tf.convert_to_tensor(layer.beta) if layer.center else tf.zeros([channels], tf.float32)
    empty = tf.constant([], tf.float32)
    y, mean, unbiased, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=offset, mean=empty, variance=empty, epsilon=layer.epsilon,
        exponential_avg_factor=1.0, data_format="NHWC", is_training=True)
    # The kernel returns the unbiased variance (n / (n - 1), n > 1); Keras' moving variance averages the biased one.
    n = tf.cast(tf.size(x) // channels, tf.float32)
    variance = unbiased * tf.where(n > 1.0, (n - 1.0) / tf.maximum(n, 1.0), 1.0)
    momentum = layer.momentum
    layer.moving_mean.assign(layer.moving_mean * momentum + mean * (1.0 - momentum))
    layer.moving_variance.assign(layer.moving_variance * momentum + variance * (1.0 - momentum))
    if len(inputs.shape) != 4:
        y = tf.reshape(y, shape)
    return tf.cast(y, layer.compute_dtype)
