"""One-pixel convolutions as matrix products: Keras' convolutions whose output is one pixel.

An ImageNet network given small images (CIFAR's 32x32 into `keras.applications`) ends in
convolutions whose maps are one pixel: ResNet50's last stage (`conv5`, 15 M of its 23.5 M
weights), DenseNet121's last block, MobileNetV2's and EfficientNetB0's last layers. Such a
convolution is a matrix product: of the kernel's taps only those that meet the input
(the centre tap of a 3x3 kernel with `padding="same"` on a 1x1 map) add anything, and the
others meet only padding. TensorFlow still runs it as a convolution, and its kernels are
slow on one-pixel maps: with oneDNN, the weight gradients of ResNet50's `conv5` take a
large share of the step's op time (docs/conv_matmul.md).

`BoostModel.compile(conv_matmul=True)`, and the boost levels O1 and O2, compute each such
convolution inside the boost step's forward pass as one matrix product of the input pixels
the kernel meets and those taps (for a depthwise convolution, a product per channel). It is
an `around_forward` stage, as the fused BatchNorm: while the step's forward pass is traced,
the layers answer with the matrix product; the swap is an instance attribute removed on
exit, so `evaluate`, `predict` and everything outside the step see Keras' layer, and the
layers keep their class, config, variables and weights.

What a layer computes is Keras' convolution: the same sums, in another order (float
rounding); the taps that meet only padding get a gradient of exactly zero, as they do from
the convolution. A call takes the matrix product only where its input's spatial size is
known when the step is traced and its output is one pixel; other calls, and layers the rule
does not fit (channels first, `groups` > 1, `padding="causal"`, a subclass that overrides
the convolution or the call, as Keras' `Conv1D` does), keep Keras' call.
"""

import itertools
import math

import tensorflow as tf

from keras_boost import _keras_compat
from keras_boost.core.contract import Stage
from keras_boost.stages import swap

_BaseConv = _keras_compat.BaseConv
_BaseDepthwiseConv = _keras_compat.BaseDepthwiseConv


class ConvMatmul(Stage):
    """Computes the model's one-pixel convolutions as matrix products inside the step.

    No arguments and no state. `layers` (after `build`) lists the convolution layers the
    rule may apply to; `not_eligible` maps the names of the others to why not; `rewritten`
    holds the names of the layers whose traced call took the matrix product.
    """

    option = "conv_matmul"
    option_help = 'True: convolutions whose output is one pixel computed as matrix products (on at O1/O2).'
    on_with_true = True

    def report(self, step):
        return {"conv_matmul": len(self.rewritten)}

    def __init__(self):
        self.layers, self.not_eligible, self.rewritten = [], {}, set()

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """On at a level that switches any feature on, unless `"boost": {"conv_matmul": False}`."""
        return cls() if boost_config.conv_matmul and not validate else None

    def build(self, context):
        self.layers, self.not_eligible, self.rewritten = [], {}, set()
        for layer in _keras_compat.flatten_layers(context.model):
            if not isinstance(layer, (_BaseConv, _BaseDepthwiseConv)):
                continue
            reason = why_not(layer)
            if reason is None:
                self.layers.append(layer)
            else:
                self.not_eligible[layer.name] = reason

    def around_forward(self, model):
        return matmul_calls(self.layers, self.rewritten)


def why_not(layer):
    """None when `layer` (a Keras convolution) may run as a matrix product where its output is one pixel; else why not."""
    if isinstance(layer, _BaseConv):
        if type(layer).convolution_op is not _BaseConv.convolution_op:
            return f"{type(layer).__name__} overrides convolution_op"
        if type(layer).call is not _BaseConv.call:  # Keras' Conv1D (for "causal") calls ops.conv itself
            return f"{type(layer).__name__} overrides call"
        if layer.groups != 1:
            return f"groups={layer.groups}"
    elif type(layer).call is not _BaseDepthwiseConv.call:
        return f"{type(layer).__name__} overrides call"
    if layer.data_format != "channels_last":
        return f"data_format={layer.data_format!r}"
    if layer.padding not in ("same", "valid"):
        return f"padding={layer.padding!r}"
    return None


def one_pixel_taps(spatial, kernel_size, strides, dilation_rate, padding):
    """The (kernel index, input index) pairs per spatial axis when the convolution's output is one pixel; else None.

    TensorFlow's padding: "valid" pads nothing; "same" makes the output ceil(n / stride)
    long and pads (total // 2) before.
    """
    taps = []
    for n, k, s, d in zip(spatial, kernel_size, strides, dilation_rate):
        if n is None:
            return None
        span = (k - 1) * d + 1
        if padding == "valid":
            out, before = (n - span) // s + 1, 0
        else:
            out = math.ceil(n / s)
            before = max((out - 1) * s + span - n, 0) // 2
        if out != 1:
            return None
        taps.append([(i, i * d - before) for i in range(k) if 0 <= i * d - before < n])
    return taps


def matmul_calls(layers, rewritten=None):
    """While inside, each of `layers` computes a one-pixel output as a matrix product (eager or traced).

    Reentrant and thread-safe (`keras_boost.stages.swap`). `rewritten`, a set, gets the name
    of every layer whose call took the matrix product.
    """
    return swap.swapped(layers, lambda layer: "convolution_op" if isinstance(layer, _BaseConv) else "call",
                        lambda layer: (_conv_op if isinstance(layer, _BaseConv) else _depthwise_call)(layer, rewritten))


def _taps_of(layer, inputs):
    if len(inputs.shape) != layer.rank + 2:
        return None
    return one_pixel_taps(inputs.shape[1:-1], layer.kernel_size, layer.strides, layer.dilation_rate, layer.padding)


def _gathered(inputs, kernel, taps):
    """The input pixels and the kernel taps that meet, stacked on a new axis 1 and 0: [N, T, C], [T, ...]."""
    pixels, weights = [], []
    for pairs in itertools.product(*taps):
        kernel_index = tuple(k for k, _ in pairs)
        pixel_index = tuple(p for _, p in pairs)
        pixels.append(inputs[(slice(None), *pixel_index)])
        weights.append(kernel[kernel_index])
    return tf.stack(pixels, axis=1), tf.stack(weights, axis=0)


def _conv_op(layer, rewritten):
    keras_op = type(layer).convolution_op.__get__(layer)

    def convolution_op(inputs, kernel):
        taps = _taps_of(layer, inputs)
        if taps is None:
            return keras_op(inputs, kernel)
        if rewritten is not None:
            rewritten.add(layer.name)
        kernel = tf.convert_to_tensor(kernel)
        inputs = tf.convert_to_tensor(inputs)
        if all(len(t) == 1 for t in taps):
            index = tuple(t[0] for t in taps)
            y = tf.matmul(inputs[(slice(None), *(p for _, p in index))], kernel[tuple(k for k, _ in index)])
        else:
            pixels, weights = _gathered(inputs, kernel, taps)
            channels = inputs.shape[-1]
            y = tf.matmul(tf.reshape(pixels, [-1, pixels.shape[1] * channels]),
                          tf.reshape(weights, [weights.shape[0] * channels, kernel.shape[-1]]))
        return tf.reshape(y, [-1, *([1] * layer.rank), kernel.shape[-1]])

    return convolution_op


def _depthwise_call(layer, rewritten):
    keras_call = type(layer).call.__get__(layer)

    def call(inputs):
        taps = _taps_of(layer, inputs)
        if taps is None:
            return keras_call(inputs)
        if rewritten is not None:
            rewritten.add(layer.name)
        inputs = tf.convert_to_tensor(inputs)
        kernel = tf.convert_to_tensor(layer.kernel)  # [k..., C, M]
        pixels, weights = _gathered(inputs, kernel, taps)  # [N, T, C], [T, C, M]
        y = tf.einsum("ntc,tcm->ncm", pixels, weights)
        y = tf.reshape(y, [-1, *([1] * layer.rank), weights.shape[1] * weights.shape[2]])
        if layer.use_bias:
            y = y + layer.bias
        return layer.activation(y) if layer.activation is not None else y

    return call
