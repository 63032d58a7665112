"""Gradient centralization: a boost-step stage that removes each filter's mean gradient.

The form of MindSpore's optimizer `grad_centralization` groups (Yong et al., "Gradient
Centralization", ECCV 2020). Keras kernels are laid out `(..., in, out)`, so a
gradient is centred over every axis except the last (the output channel), and
MindSpore's `shape[1] % 16 == 0` test on its `(out, in, ...)` layout becomes a test
on the second-to-last (input-channel) axis.
"""

import keras
import tensorflow as tf

from keras_boost import _keras_compat
from keras_boost._validation import check_int
from keras_boost.graph.layers import FNHead
from keras_boost.graph.less_bn import removed_batchnorms
from keras_boost.core.contract import Stage

_L = keras.layers
_PLAIN_CONVS = (_L.Conv1D, _L.Conv2D, _L.Conv3D)


_MODEL_DEFAULT = object()  # `variables` left out: the model's gc_variables, chosen at build
_EVERY_KERNEL = object()  # the keras-io rule: every trainable variable of rank >= 2, chosen at build


class GradientCentralization(Stage):
    """Centres the gradients of selected kernels: `g - mean(g, axes=all but last)`.

    A gradient is centred when its variable is one of `variables`, it has rank 2 or
    more, and its input-channel size (`shape[-2]`) is a multiple of
    `min_channels_multiple`; every other gradient, and every `None`, passes through.
    The stage has no state and works eagerly and inside `tf.function`.

    Args:
        variables: list or tuple of Keras variables to centralise, or of their `path`s;
            left out: `gc_variables(model)` of the model the step trains, resolved when
            the step is built. May be empty (the stage is then the identity).
        min_channels_multiple: positive int; MindSpore centralises only kernels whose
            input-channel count is a multiple of 16, which leaves out the first conv of
            an RGB network. Defaults to 16; 1 centralises every selected kernel.

    Example:

    >>> model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(16)])
    >>> stage = GradientCentralization(gc_variables(model))
    >>> grads = stage.apply([tf.ones((32, 16)), tf.ones((16,))], model.trainable_variables)
    >>> float(tf.reduce_max(tf.abs(grads[0])))
    0.0
    """

    option = "gradient_centralization"
    option_help = ('True or "mindspore" (MindSpore\'s rule: conv/dense kernels whose input channels are a multiple of'
                   ' 16), "all" (the keras-io recipe: every gradient of rank 2 or more), or a '
                   '`GradientCentralization`.')
    option_values = "None, a bool, 'mindspore', 'all'"
    measurable = True
    level_section = "less_bn"  # a level's GC is LessBN's gc_flag
    # A boost level's GC is LessBN's companion for accuracy, not for speed (without it O1
    # lost 5.6 pp on the demo ResNet, docs/auto_boost.md). So where LessBN removed a
    # BatchNorm it stays on whatever it costs (`verdict` says what it costs), and where LessBN
    # removed none it is switched off when the step is built: there is nothing to make up
    # for. An explicit GC, or one whose `less_bn` section the configuration gives, always stays.
    _removed_batchnorms = 0

    def __init__(self, variables=_MODEL_DEFAULT, min_channels_multiple=16):
        if variables not in (_MODEL_DEFAULT, _EVERY_KERNEL) and (not isinstance(variables, (list, tuple)) or not (
            all(isinstance(v, keras.Variable) for v in variables) or all(isinstance(v, str) for v in variables)
        )):
            raise TypeError(
                "`variables` must be a list or tuple of keras.Variable (or of variable paths), or be left out for "
                f"the model's `gc_variables`, got {_describe(variables)}."
            )
        self.min_channels_multiple = check_int("min_channels_multiple", min_channels_multiple, 1)
        self.variables, self._selected = [], set()
        # None or paths are resolved from the model when the step is built.
        self._resolve_at_build = variables in (_MODEL_DEFAULT, _EVERY_KERNEL) or any(
            isinstance(v, str) for v in variables)
        self._paths = variables if variables in (_MODEL_DEFAULT, _EVERY_KERNEL) else list(variables)
        if not self._resolve_at_build:
            self._select(variables)

    def _select(self, variables):
        self.variables = list(variables)
        self._selected = {id(v) for v in self.variables}

    @classmethod
    def every_kernel(cls):
        """The keras-io recipe: centralise every trainable variable of rank 2 or more."""
        return cls(_EVERY_KERNEL, min_channels_multiple=1)

    @classmethod
    def from_option(cls, value, model):
        """None/False; True or "mindspore" (MindSpore's rule: the kernels of `gc_variables(model)`
        whose input channels are a multiple of 16); "all" (the keras-io recipe: every trainable
        variable of rank 2 or more); or a `GradientCentralization`."""
        if value is True or (isinstance(value, str) and value == "mindspore"):
            return cls()
        if isinstance(value, str) and value == "all":
            return cls.every_kernel()
        if isinstance(value, str):
            raise cls.bad_option(value, ValueError)
        return super().from_option(value, model)

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """LessBN's `gc_flag`: MindSpore's rule on the model's `gc_variables`."""
        less_bn = boost_config.features["less_bn"] and boost_config.params["less_bn"]["gc_flag"]
        return cls() if less_bn and not validate else None

    def build(self, context):
        self._removed_batchnorms = removed_batchnorms(context.model) or 0
        if self.switch is not None and not self._removed_batchnorms:
            self.switch_off()  # a level's GC, on a model where LessBN removed no BatchNorm
        if not self._resolve_at_build:
            return
        # A step knows its model; an optimizer (`CentralizedOptimizer`) only the variables it is built on.
        model = context.model
        candidates = list(model.trainable_variables) if model is not None else list(context.variables)
        if self._paths is _MODEL_DEFAULT and model is not None:
            self._select(gc_variables(model))
        elif self._paths in (_MODEL_DEFAULT, _EVERY_KERNEL):
            self._select([v for v in candidates if len(v.shape) >= 2])
        else:
            found = {p: [v for v in candidates if _same_path(v.path, p)] for p in self._paths}
            missing = [p for p, matches in found.items() if not matches]
            if missing:
                raise ValueError(f"`variables` names variables that are not trained here: {missing[:3]}")
            self._select([v for p in self._paths for v in found[p][:1]])
        self._resolve_at_build = False

    @property
    def resolved(self):
        """Whether the centralised variables are chosen (at construction, or when built)."""
        return not self._resolve_at_build

    def column_sums(self, grads, variables):
        """Each centralised gradient's per-channel sums (`ones(1, n) @ grad`), for the finite check and `transform`."""
        return [column_sums(g, v.shape) if g is not None and g.dtype in (tf.float32, tf.float64) and self.applies_to(v)
                else None for g, v in zip(grads, variables)]

    def transform(self, grads, variables, sums=None):
        if self.switch is None:
            return self.apply(grads, variables, sums)
        return tf.cond(self.active(), lambda: self.apply(grads, variables, sums), lambda: list(grads))

    def measure_alone(self, repeats=5):
        """{"centralize": seconds}: one pass over the selected kernels' shapes, timed out of the step.

        The kernels themselves stand in for their gradients (same shapes and dtypes); the
        median of `repeats` runs after one that compiles.
        """
        import time

        selected = [v for v in self.variables if self.applies_to(v)]
        if not selected:
            return {"centralize": 0.0}
        run = tf.function(lambda: [centralize(v.value) for v in selected], autograph=False)
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = run()
            _ = [o.numpy().flat[0] for o in outputs[:1]]
            times.append(time.perf_counter() - start)
        return {"centralize": sorted(times)[len(times) // 2]}

    def verdict(self, times, alone):
        share = alone["centralize"] / times[0]
        # Timed alone, GC reads gradients that are out of cache; in the step each one is
        # centred right after the backward pass wrote it, beside the layers still to go, and
        # costs less there (docs/benchmarks.md). So this is an upper bound.
        return True, (f"centralizing costs at most {1000 * alone['centralize']:.1f} ms of a {1000 * times[0]:.1f} ms "
                      f"step ({100 * share:.1f}%, timed alone; less inside the step); kept for accuracy, since LessBN "
                      f"removed {self._removed_batchnorms} BatchNormalization layers")

    def get_config(self):
        if self._paths is _MODEL_DEFAULT and self._resolve_at_build:
            variables = None  # the default, still to be chosen where it is built
        elif self._paths is _EVERY_KERNEL and self._resolve_at_build:
            variables = "every_kernel"
        elif self._resolve_at_build:
            variables = list(self._paths)
        else:
            variables = [v.path for v in self.variables]
        return {"variables": variables, "min_channels_multiple": self.min_channels_multiple}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        variables = config.pop("variables", None)
        if variables == "every_kernel":
            return cls(_EVERY_KERNEL, **config)
        return cls(**config) if variables is None else cls(variables, **config)

    def applies_to(self, variable):
        """Whether the gradient of `variable` gets centralised."""
        shape = variable.shape
        return id(variable) in self._selected and centralizes(shape, self.min_channels_multiple)

    def apply(self, grads, variables, sums=None):
        """Returns `grads` with the selected ones centralised.

        Args:
            grads: list of gradients (tensors or `None`), parallel to `variables`.
            variables: list of the variables the gradients belong to.
            sums: None, or `column_sums(grads, variables)` computed before (by the step, for
                its finite check), so that no gradient is summed twice.

        Returns:
            A new list of the same length as `grads`.
        """
        if len(grads) != len(variables):
            raise ValueError(
                f"`grads` and `variables` must have the same length, got {len(grads)} "
                f"gradients and {len(variables)} variables."
            )
        sums = [None] * len(grads) if sums is None else sums
        return [
            centralize(g, s, shape=v.shape) if g is not None and self.applies_to(v) else g
            for g, v, s in zip(grads, variables, sums)
        ]


def _same_path(path, wanted):
    """Whether `path` is `wanted`, allowing for a model-name prefix added or dropped when a model is loaded."""
    return path == wanted or path.endswith("/" + wanted) or wanted.endswith("/" + path)


def centralizes(shape, min_channels_multiple):
    """The selection rule: rank 2 or more, input channels (`shape[-2]`) a multiple of `min_channels_multiple`."""
    return len(shape) >= 2 and shape[-2] % min_channels_multiple == 0


def column_sums(grad, shape=None):
    """Each output channel's sum of `grad`, shape `(1, channels)`: `ones(1, n) @ grad` (see `centralize`).

    A `tf.IndexedSlices` gradient (an `Embedding` table's) is summed over its rows of
    values, without making it dense: the dense gradient adds repeated rows, so its column
    sums are the same. `shape`: the variable's shape (see `_known_shape`).
    """
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values
        return tf.reduce_sum(tf.reshape(values, [-1, values.shape[-1]]), axis=0, keepdims=True)
    grad = _known_shape(tf.convert_to_tensor(grad), shape)
    channels = grad.shape[-1]
    rows = grad.shape.num_elements() // channels
    return tf.matmul(tf.ones([1, rows], grad.dtype), tf.reshape(grad, [rows, channels]))


def centralize(grad, sums=None, shape=None):
    """`grad - mean(grad, axes=all but the last)`: each output channel's mean gradient removed.

    The means are one matrix product, `ones(1, n) @ grad` with `grad` seen as `(n, channels)`
    (a free reshape: the channels are the last axis), which TensorFlow's CPU matmul runs
    at memory speed on every core, faster than `tf.reduce_mean` (docs/benchmarks.md). The
    results agree within float32 rounding (the sums run in another order). `sums`: those
    sums computed before (`column_sums(grad)`), or None to compute them here.

    A `tf.IndexedSlices` gradient (an `Embedding` table's, rows of a `(vocabulary, dim)`
    kernel) comes back dense, as the keras-io recipe's `grad - mean(grad)` makes it: every
    row moves by minus the mean. `shape`: the variable's shape, which such a gradient's
    static shape does not carry (None: read from its `dense_shape` when that is a constant).
    """
    sums = column_sums(grad, shape) if sums is None else sums
    grad = _known_shape(_dense(grad, shape), shape)
    return grad - sums / (grad.shape.num_elements() // grad.shape[-1])  # (1, channels) broadcasts over leading axes


def _known_shape(grad, shape):
    """`grad` with the variable's static `shape` where tracing lost some of it.

    A gradient's static shape is normally its variable's, but not always: keras-io's
    MLP-Mixer applies a Dense to patches, and once a partial last batch retraces the step
    with a batch dimension of None, that kernel's gradient is traced as `(None, 32)`.
    The variable's shape is always known; the reshape to it moves no data.
    """
    if grad.shape.is_fully_defined() or shape is None:
        return grad
    return tf.reshape(grad, tf.TensorShape(shape).as_list())


def _dense(grad, shape):
    if not isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    if shape is None:
        shape = tf.get_static_value(grad.dense_shape)
    if shape is None or any(d is None for d in tf.TensorShape(shape).as_list()):
        raise ValueError("centralize: a tf.IndexedSlices gradient needs `shape` (the variable's shape); its "
                         f"dense_shape {grad.dense_shape!r} is not known while tracing.")
    return tf.reshape(tf.convert_to_tensor(grad), tf.TensorShape(shape).as_list())  # repeated rows added


def _describe(value):
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return f"{type(value).__name__}"


def gc_variables(model):
    """The kernels MindSpore's AutoBoost puts in its gradient-centralization group.

    Selected: kernels of Conv1D/2D/3D with `groups == 1`, the pointwise kernel of
    SeparableConv1D/2D, and kernels of Dense and EinsumDense, when trainable. Not
    selected: biases, normalisation parameters, depthwise and grouped kernels,
    transposed-conv kernels (laid out `(..., out, in)`), and the `FNHead`.

    Args:
        model: a Keras layer or model; nested layers and models are searched.

    Returns:
        A list of variables, in layer order, without duplicates.

    Example:

    >>> model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, name="conv")],
    ...                          name="net")
    >>> [v.path for v in gc_variables(model)]
    ['net/conv/kernel']
    """
    if not isinstance(model, _L.Layer):
        raise TypeError(f"`model` must be a Keras layer or model, got {type(model).__name__}.")
    selected, seen = [], set()
    for layer in _keras_compat.flatten_layers(model):
        for variable in _layer_gc_variables(layer):
            if id(variable) not in seen:
                seen.add(id(variable))
                selected.append(variable)
    return selected


def _layer_gc_variables(layer):
    if isinstance(layer, FNHead) or not layer.built:
        return []
    if isinstance(layer, _PLAIN_CONVS) and layer.groups == 1:
        candidates = [layer.kernel]
    elif isinstance(layer, (_L.SeparableConv1D, _L.SeparableConv2D)):
        candidates = [layer.pointwise_kernel]
    elif isinstance(layer, (_L.Dense, _L.EinsumDense)):
        # With LoRA or quantization, `kernel` is a computed tensor, not a variable.
        candidates = [layer.kernel]
    else:
        return []
    return [v for v in candidates if isinstance(v, keras.Variable) and v.trainable]
