"""The FN head: a cosine-similarity classifier with a learnable temperature.

`FNHead` is keras_boost's form of MindSpore's `CommonHeadLastFN`, the layer that
`LessBN(model, fn_flag=True)` puts in place of the last Dense classifier.
"""

import keras
from keras import ops

from keras_boost._validation import check_int, check_real

# MindSpore's L2Normalize default epsilon, applied to the squared norm.
_EPSILON = 1e-4


def _l2_normalize(x, axis):
    squared_norm = ops.sum(ops.square(x), axis=axis, keepdims=True)
    return x / ops.sqrt(ops.maximum(squared_norm, _EPSILON))


@keras.saving.register_keras_serializable(package="keras_boost")
class FNHead(keras.layers.Layer):
    """Cosine-similarity classifier: `multiplier * cos(input, class weight)`.

    Each input row x and each kernel column W_c (one column per class, the Dense
    layout `(input_dim, units)`) is normalised as `v / sqrt(max(sum(v**2), 1e-4))`,
    and logit c is `multiplier * dot(x_hat, W_hat_c)`. `multiplier` is a trainable
    scalar initialised to 1.0; there is no bias. The arithmetic runs in float32
    whatever the dtype policy, so squared norms cannot overflow in float16.

    Args:
        units: positive int, the number of classes (output features).
        kernel_initializer: initializer of the `(input_dim, units)` kernel.
            Defaults to `"glorot_uniform"`.
        **kwargs: base `Layer` arguments (`name`, `dtype`, ...).

    Example:

    >>> head = FNHead(10)
    >>> logits = head(keras.ops.ones((2, 64)))
    >>> tuple(logits.shape)
    (2, 10)
    """

    def __init__(self, units, kernel_initializer="glorot_uniform", initial_multiplier=1.0, **kwargs):
        super().__init__(**kwargs)
        self.units = check_int("units", units, 1)
        self.initial_multiplier = check_real("initial_multiplier", initial_multiplier, low=0, low_inclusive=False)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    @classmethod
    def from_dense(cls, dense, initial_multiplier=1.0):
        """Builds an FN head with the name, dtype policy and kernel of a built Dense.

        The Dense bias is dropped, as MindSpore's LessBN does; keeping the Dense's
        name keeps the kernel's variable path (`"<name>/kernel"`).

        Args:
            dense: a built `keras.layers.Dense`.
            initial_multiplier: the multiplier's starting value (default 1.0, MindSpore's).

        Returns:
            A built `FNHead` whose kernel equals `dense.kernel`.
        """
        if not isinstance(dense, keras.layers.Dense):
            raise TypeError(f"`dense` must be a keras.layers.Dense, got {type(dense).__name__}.")
        if not dense.built:
            raise ValueError(f"`dense` ({dense.name}) must be built to copy its kernel.")
        head = cls(dense.units, name=dense.name, dtype=dense.dtype_policy, initial_multiplier=initial_multiplier)
        head.build((None, dense.kernel.shape[0]))
        head.kernel.assign(dense.kernel)
        return head

    def build(self, input_shape):
        input_dim = input_shape[-1]
        if input_dim is None:
            raise ValueError(f"FNHead needs a known last input dimension, got shape {input_shape}.")
        self.kernel = self.add_weight(
            name="kernel", shape=(input_dim, self.units), initializer=self.kernel_initializer
        )
        self.multiplier = self.add_weight(name="multiplier", shape=(),
                                          initializer=keras.initializers.Constant(self.initial_multiplier))

    def call(self, inputs):
        x_hat = _l2_normalize(ops.cast(inputs, "float32"), axis=-1)
        w_hat = _l2_normalize(ops.cast(self.kernel, "float32"), axis=0)
        logits = ops.cast(self.multiplier, "float32") * ops.matmul(x_hat, w_hat)
        return ops.cast(logits, self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "units": self.units,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "initial_multiplier": self.initial_multiplier,
            }
        )
        return config
