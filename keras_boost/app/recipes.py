"""The models `keras-boost train` and `keras-boost bench` train, each with its own recipe.

A recipe is what its author trains the model with: the network, how the images become its
input, the optimizer and its learning rate, the batch size and whether the head gives
logits. Four are keras-io examples written by others, kept as their pages write them, with
Fashion-MNIST (Debian's package; nothing is downloaded) standing in for their data:

- `mnist_convnet`: examples/vision/mnist_convnet.py (two convolutions, Dropout, softmax; Adam);
- `timeseries`: examples/timeseries/timeseries_classification_from_scratch.py (three Conv1D
  with BatchNorm, global average pooling, softmax; Adam, batch 32) on each image read as a
  series of 28 steps (its rows) of 28 values, where the page reads FordA's 500-step series
  of one value;
- `xception`: examples/vision/image_classification_from_scratch.py (the small Xception:
  separable convolutions, residual 1x1 convolutions, BatchNorms, Dropout, a logits Dense; Adam
  3e-4), at 28x28x1 where the page trains 180x180x3 photographs;
- `transformer`: examples/nlp/text_classification_with_transformer.py (token and position
  embeddings, one transformer block with LayerNorms, softmax; Adam, batch 32) on each image
  pooled to 14x14 and read as 196 tokens of 256 grey levels, where the page reads IMDB
  reviews as 200 tokens of a 20,000-word vocabulary.

`demo` is keras_boost's residual network, and the keras.applications families train from
scratch on 32x32x3 copies of the images, both with SGD and momentum 0.9 and a logits head.
"""

import collections

import keras
import numpy as np

from keras_boost.app.demo_net import demo_resnet

APPLICATIONS = {
    "resnet50": "ResNet50",
    "resnet101": "ResNet101",
    "resnet50v2": "ResNet50V2",
    "mobilenetv2": "MobileNetV2",
    "densenet121": "DenseNet121",
}

# build: () -> functional keras.Model (seeded by the caller); inputs: 28x28x1 images in [0, 1]
# -> the model's input; optimizer: lr -> optimizer; lr and batch_size: the recipe's own.
Recipe = collections.namedtuple("Recipe", "build inputs optimizer lr batch_size from_logits")


def to_rgb32(images):
    """28x28x1 images as the 32x32x3 input keras.applications models accept (zero pad, 3 channels)."""
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2), (0, 0)))
    return np.repeat(padded, 3, axis=-1)


def as_series(images):
    """Each 28x28 image as a 28-step series (its rows, top to bottom) of 28 values."""
    return images.reshape(len(images), 28, 28)


def as_tokens(images):
    """Each 28x28 image pooled 2x2 to 14x14, read as 196 tokens: grey levels 0..255."""
    pooled = images.reshape(len(images), 14, 2, 14, 2).mean(axis=(2, 4))
    return np.clip(np.rint(pooled * 255), 0, 255).astype(np.int32).reshape(len(images), 196)


def _sgd(lr):
    return keras.optimizers.SGD(lr, momentum=0.9)


def _adam(lr):
    return keras.optimizers.Adam(lr)


def mnist_convnet(input_shape=(28, 28, 1), classes=10):
    layers = keras.layers
    return keras.Sequential([
        keras.Input(input_shape),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"), layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"), layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(), layers.Dropout(0.5),
        layers.Dense(classes, activation="softmax"),
    ], name="mnist_convnet")


def timeseries_fcn(length=28, channels=28, classes=10):
    layers = keras.layers
    inputs = keras.Input((length, channels))
    x = inputs
    for _ in range(3):
        x = layers.Conv1D(filters=64, kernel_size=3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="timeseries_fcn")


def small_xception(input_shape=(28, 28, 1), classes=10):
    layers = keras.layers
    inputs = keras.Input(input_shape)
    x = layers.Conv2D(128, 3, strides=2, padding="same")(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous = x
    for size in (256, 512, 728):
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous)
        x = layers.add([x, residual])
        previous = x
    x = layers.SeparableConv2D(1024, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    outputs = layers.Dense(classes, activation=None)(x)
    return keras.Model(inputs, outputs, name="small_xception")


class TransformerBlock(keras.layers.Layer):
    """keras-io's transformer block: self-attention and a feed-forward network, each with Dropout, a residual and a LayerNorm."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)])
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs)
        out1 = self.layernorm1(inputs + self.dropout1(attn_output, training=training))
        ffn_output = self.ffn(out1)
        return self.layernorm2(out1 + self.dropout2(ffn_output, training=training))


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras-io's embedding: a token's embedding plus its position's."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


def text_transformer(maxlen=196, vocab_size=256, classes=10, embed_dim=32, num_heads=2, ff_dim=32):
    layers = keras.layers
    inputs = keras.Input(shape=(maxlen,), dtype="int32")
    x = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, ff_dim)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(classes, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="text_transformer")


def _application(name):
    def build():
        factory = getattr(keras.applications, APPLICATIONS[name])
        return factory(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None)
    return build


def _identity(images):
    return images


RECIPES = {
    "demo": Recipe(lambda: demo_resnet(model_class=keras.Model), _identity, _sgd, 0.05, 64, True),
    **{name: Recipe(_application(name), to_rgb32, _sgd, 0.05, 64, True) for name in APPLICATIONS},
    "mnist_convnet": Recipe(mnist_convnet, _identity, _adam, 1e-3, 128, False),
    "timeseries": Recipe(timeseries_fcn, as_series, _adam, 1e-3, 32, False),
    "xception": Recipe(small_xception, _identity, _adam, 3e-4, 128, True),
    "transformer": Recipe(text_transformer, as_tokens, _adam, 1e-3, 32, False),
}
MODELS = tuple(RECIPES)


def recipe(name):
    if name not in RECIPES:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return RECIPES[name]
