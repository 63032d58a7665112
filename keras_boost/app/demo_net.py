"""The demo network: a small residual CNN with a BatchNorm after every convolution."""

import keras

from keras_boost.model import BoostModel

# MindSpore's BatchNorm default; Keras' 0.99 leaves the moving statistics far from the
# batch statistics after the few hundred steps of a short run.
BN_MOMENTUM = 0.9


def _conv_bn(x, filters, stride, name, relu=True):
    x = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False, name=f"{name}_conv")(x)
    x = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"{name}_bn")(x)
    return keras.layers.ReLU(name=f"{name}_relu")(x) if relu else x


def _basic_block(x, filters, stride, name):
    shortcut = x
    y = _conv_bn(x, filters, stride, f"{name}_1")
    y = _conv_bn(y, filters, 1, f"{name}_2", relu=False)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False, name=f"{name}_proj_conv")(x)
        shortcut = keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name=f"{name}_proj_bn")(shortcut)
    y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
    return keras.layers.ReLU(name=f"{name}_out")(y)


def demo_resnet(input_shape=(28, 28, 1), classes=10, widths=(16, 32, 64), blocks_per_stage=1, model_class=BoostModel):
    """A ResNet-style CNN: stem conv-BN-ReLU, residual stages (BN after every conv), GAP, Dense.

    With the defaults it has 3 residual stages of one basic block each, two of them with
    a projection shortcut: 9 convolutions and 9 BatchNorms, about 80k parameters.
    """
    inputs = keras.Input(input_shape, name="image")
    x = _conv_bn(inputs, widths[0], 1, "stem")
    for stage, filters in enumerate(widths):
        for block in range(blocks_per_stage):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _basic_block(x, filters, stride, f"s{stage}b{block}")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(classes, dtype="float32", name="classifier")(x)  # float32 logits under mixed precision
    return model_class(inputs, outputs, name="demo_resnet")
