"""LessBN: which BatchNorms each rule removes, graph fidelity, FN head, validation."""

import logging
import re
import warnings

import keras
import numpy as np
import pytest

from keras_boost import BoostModel
from keras_boost.graph.layers import FNHead
from keras_boost.graph.less_bn import LessBN, LessBNReport

BN = keras.layers.BatchNormalization
X32 = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)


def _bn_names(model):
    return [layer.name for layer in model.layers if isinstance(layer, BN)]


def _conv_bn_relu(x, filters, kernel, name, strides=1):
    x = keras.layers.Conv2D(filters, kernel, strides, padding="same", name=f"{name}_conv")(x)
    x = BN(name=f"{name}_bn")(x)
    return keras.layers.ReLU(name=f"{name}_relu")(x)


def _basic_block(x, filters, name, strides=1):
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides, name=f"{name}_shortcut_conv")(x)
        shortcut = BN(name=f"{name}_shortcut_bn")(shortcut)
    y = _conv_bn_relu(x, filters, 3, f"{name}_1", strides)
    y = keras.layers.Conv2D(filters, 3, padding="same", name=f"{name}_2_conv")(y)
    y = BN(name=f"{name}_2_bn")(y)
    return keras.layers.ReLU(name=f"{name}_out")(keras.layers.Add(name=f"{name}_add")([shortcut, y]))


def residual_cnn(model_class=keras.Model, activation=None):
    """Stem, an identity block, a projection block, an identity block, GAP, Dense 10."""
    inputs = keras.Input((16, 16, 3), name="image")
    x = _conv_bn_relu(inputs, 8, 3, "stem")
    x = _basic_block(x, 8, "block1")
    x = _basic_block(x, 16, "block2", strides=2)
    x = _basic_block(x, 16, "block3")
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(10, activation=activation, name="logits")(x)
    return model_class(inputs, outputs, name="residual_cnn")


def _set_removed_bns_to_identity(model, report):
    """Makes the BNs LessBN removed compute the identity in inference."""
    for name in report.removed:
        bn = model.get_layer(name)
        bn.set_weights([np.ones(bn.gamma.shape), np.zeros(bn.beta.shape),
                        np.zeros(bn.moving_mean.shape), np.full(bn.moving_variance.shape, 1 - bn.epsilon)])


def _assert_same_function_without_removed_bns(model, lean, output=None):
    """With its removed BNs made identities, `model` computes what `lean` computes.

    Compared on logits (or on the input of the layer named `output`), never on softmax
    probabilities, which stay nearly uniform for random weights and hide the error: the
    tolerance is 1e-4 of the spread of the compared values, and the spread must be real.
    """
    _set_removed_bns_to_identity(model, lean.less_bn_report)
    if output is not None:
        model = keras.Model(model.inputs, model.get_layer(output).input)
        lean = keras.Model(lean.inputs, lean.get_layer(output).input)
    expected = np.asarray(model(X32, training=False))
    got = np.asarray(lean(X32, training=False))
    spread = float(np.ptp(expected))
    assert spread > 1e-3, spread  # not a near-constant output
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * spread)


def _randomize_bns(model, seed=0):
    """Gives every BN a random scale and offset: with the initial ones (gamma 1, beta 0)
    MobileNetV2's pooled features collapse to a spread of ~5e-12 in inference. The moving
    statistics stay new (mean 0, variance 1): LessBN keeps a BN whose statistics were learnt."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, BN):
            n = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, n), rng.uniform(0.0, 0.5, n), np.zeros(n), np.ones(n)])


def _assert_kept_weights_equal(model, lean):
    for layer in lean.layers:
        if layer.weights and not isinstance(layer, FNHead):
            original = model.get_layer(layer.name).get_weights()
            assert all(np.array_equal(a, b) for a, b in zip(layer.get_weights(), original)), layer.name


def _paths(model):
    return {v.path for v in model.weights}


def _removed_paths(model, lean):
    return {v.path for name in lean.less_bn_report.removed for v in model.get_layer(name).weights}


def _train_one_step(model):
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(1).normal(size=(4,) + tuple(model.input.shape[1:])).astype(np.float32)
    loss = model.train_on_batch(x, np.arange(4) % 10)
    assert np.isfinite(loss)


# ------------------------------------------------------------------ the small residual CNN

def test_residual_cnn_keeps_the_last_branch_bn_and_the_stem():
    model = residual_cnn()
    report = LessBN(model).less_bn_report
    assert report.removed == {
        "block1_1_bn": "residual-branch",
        "block2_shortcut_bn": "shortcut",
        "block2_1_bn": "residual-branch",
        "block3_1_bn": "residual-branch",
    }
    assert report.kept == ("stem_bn", "block1_2_bn", "block2_2_bn", "block3_2_bn")
    assert (report.num_removed, report.num_kept, report.fn_heads) == (4, 4, ())


def test_residual_cnn_result_computes_the_graph_without_removed_bns():
    model = residual_cnn()
    lean = LessBN(model)
    assert sorted(_bn_names(lean)) == sorted(lean.less_bn_report.kept)
    assert _paths(lean) == _paths(model) - _removed_paths(model, lean)
    assert not any(isinstance(layer, BN) for layer in lean.layers if layer.name in lean.less_bn_report.removed)
    _assert_kept_weights_equal(model, lean)
    x = np.random.default_rng(2).normal(size=(2, 16, 16, 3)).astype(np.float32)
    _set_removed_bns_to_identity(model, lean.less_bn_report)
    np.testing.assert_allclose(lean(x, training=False), model(x, training=False), rtol=1e-5, atol=1e-6)


def test_input_model_is_untouched_even_by_training_the_result():
    model = residual_cnn()
    layers_before, bns_before = len(model.layers), _bn_names(model)
    weights_before = model.get_weights()
    lean = LessBN(model, fn_flag=True)
    _train_one_step(lean)
    assert len(model.layers) == layers_before and _bn_names(model) == bns_before
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights_before))
    assert not {id(layer) for layer in lean.layers} & {id(layer) for layer in model.layers}


def test_fn_flag_replaces_the_output_dense_and_keeps_its_activation():
    model = residual_cnn(activation="softmax")
    lean = LessBN(model, fn_flag=True)
    head = lean.get_layer("logits")
    assert isinstance(head, FNHead)
    assert np.array_equal(head.kernel.numpy(), model.get_layer("logits").kernel.numpy())
    assert [v.path for v in head.weights] == ["logits/kernel", "logits/multiplier"]
    assert lean.layers[-1].name == "logits_activation"
    assert lean.layers[-1].get_config()["activation"] == "softmax"
    assert lean.less_bn_report.fn_heads == ("logits",)
    features = keras.Model(lean.input, lean.get_layer("pool").output)
    x = np.random.default_rng(3).normal(size=(2, 16, 16, 3)).astype(np.float32)
    f = np.asarray(features(x))
    w = head.kernel.numpy()
    cosine = (f / np.linalg.norm(f, axis=1, keepdims=True)) @ (w / np.linalg.norm(w, axis=0, keepdims=True))
    assert float(head.multiplier.numpy()) == 16.0  # a cosine-classifier scale, not MindSpore's 1.0 (docs/less_bn.md)
    logits = 16.0 * cosine
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(lean(x), expected, rtol=1e-5, atol=1e-6)


def test_result_with_fn_head_survives_a_keras_file_round_trip(tmp_path):
    lean = LessBN(residual_cnn(activation="softmax"), fn_flag=True)
    lean.save(tmp_path / "lean.keras")
    loaded = keras.models.load_model(tmp_path / "lean.keras")
    x = np.random.default_rng(5).normal(size=(2, 16, 16, 3)).astype(np.float32)
    assert isinstance(loaded.get_layer("logits"), FNHead)
    assert np.array_equal(loaded(x), lean(x))


def test_linear_dense_head_gets_no_activation_layer():
    lean = LessBN(residual_cnn(), fn_flag=True)
    assert isinstance(lean.layers[-1], FNHead)


def test_boost_model_input_gives_a_boost_model():
    lean = LessBN(residual_cnn(BoostModel))
    assert isinstance(lean, BoostModel)
    assert lean.name == "residual_cnn"
    assert not isinstance(LessBN(residual_cnn()), BoostModel)


def test_report_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="keras_boost.graph.less_bn"):
        lean = LessBN(residual_cnn())
    assert lean.less_bn_report.summary() in caplog.text
    assert "removed 4 of 8" in caplog.text


def test_stem_bn_is_never_removed():
    inputs = keras.Input((8, 8, 4))
    y = _conv_bn_relu(inputs, 4, 3, "first")
    y = BN(name="last_bn")(keras.layers.Conv2D(4, 3, padding="same", name="last_conv")(y))
    model = keras.Model(inputs, keras.layers.Add()([inputs, y]))
    with pytest.warns(UserWarning, match="found no BatchNormalization layer to remove"):
        report = LessBN(model).less_bn_report
    assert report.kept == ("first_bn", "last_bn")


def test_plain_network_keeps_its_only_bn():
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, name="conv"),
                              BN(name="only_bn"), keras.layers.ReLU(),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    with pytest.warns(UserWarning, match="found no BatchNormalization layer to remove"):
        assert LessBN(model).less_bn_report.kept == ("only_bn",)


# ------------------------------------------------------------------ Sequential models

def test_sequential_inverted_block_loses_expansion_and_head_bns():
    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(16, 3, name="stem"),
        BN(name="stem_bn"),
        keras.layers.ReLU(6.0),
        keras.layers.Conv2D(64, 1, name="expand"),
        BN(name="expand_bn"),
        keras.layers.ReLU(6.0),
        keras.layers.DepthwiseConv2D(3, padding="same", name="depthwise"),
        BN(name="depthwise_bn"),
        keras.layers.ReLU(6.0),
        keras.layers.Conv2D(16, 1, name="project"),
        BN(name="project_bn"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(4, name="classifier"),
    ], name="inverted")
    lean = LessBN(model, fn_flag=True)
    assert lean.less_bn_report.removed == {"expand_bn": "expansion", "project_bn": "head"}
    assert lean.less_bn_report.kept == ("stem_bn", "depthwise_bn")
    assert type(lean) is not keras.Sequential and isinstance(lean, keras.Model)
    assert isinstance(lean.get_layer("classifier"), FNHead)
    assert _paths(lean) == _paths(model) - _removed_paths(model, lean) - {"inverted/classifier/bias"} | {
        "inverted/classifier/multiplier"}
    _train_one_step(lean)


def test_model_without_removable_bn_is_copied_with_a_warning():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name="hidden"), BN(name="bn"),
                              keras.layers.Dense(3, name="out")])
    with pytest.warns(UserWarning, match="found no BatchNormalization layer to remove"):
        lean = LessBN(model)
    assert lean.less_bn_report == LessBNReport(removed={}, kept=("bn",))
    assert [layer.name for layer in lean.layers[1:]] == ["hidden", "bn", "out"]
    x = np.random.default_rng(4).normal(size=(3, 6)).astype(np.float32)
    assert np.array_equal(lean(x), model(x))


# ------------------------------------------------------------------ keras.applications

@pytest.fixture(scope="module")
def resnet50():
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10,
                                        classifier_activation=None)  # logits: compared without softmax
    return model, LessBN(model)


def test_resnet50_matches_mindspore_53_36_17(resnet50):
    model, lean = resnet50
    report = lean.less_bn_report
    names = _bn_names(model)
    assert (len(names), report.num_removed, report.num_kept) == (53, 36, 17)
    assert set(report.removed) == {n for n in names if re.search(r"_[012]_bn$", n)}
    assert list(report.removed.values()).count("shortcut") == 4
    assert set(report.kept) == {"conv1_bn"} | {n for n in names if n.endswith("_3_bn")}
    assert _bn_names(lean) == list(report.kept)
    assert len(_bn_names(model)) == 53 and len(model.layers) == 177


def test_resnet50_rewrite_is_exact(resnet50):
    model, lean = resnet50
    _assert_kept_weights_equal(model, lean)
    _assert_same_function_without_removed_bns(model, lean)


def test_resnet101_counts():
    model = keras.applications.ResNet101(weights=None, input_shape=(32, 32, 3), classes=10)
    report = LessBN(model).less_bn_report
    names = _bn_names(model)
    assert (len(names), report.num_removed, report.num_kept) == (104, 70, 34)
    assert set(report.kept) == {"conv1_bn"} | {n for n in names if n.endswith("_3_bn")}


def test_resnet50v2_keeps_last_branch_bn_and_projection_preact():
    model = keras.applications.ResNet50V2(weights=None, input_shape=(32, 32, 3), classes=10,
                                          classifier_activation=None)
    lean = LessBN(model)
    report = lean.less_bn_report
    names = _bn_names(model)
    assert (len(names), report.num_removed, report.num_kept) == (49, 28, 21)
    block1_preact = {f"conv{s}_block1_preact_bn" for s in range(2, 6)}
    assert set(report.removed) == {n for n in names if n.endswith("_1_bn")} | (
        {n for n in names if n.endswith("_preact_bn")} - block1_preact)
    assert set(report.kept) == {n for n in names if n.endswith("_2_bn")} | block1_preact | {"post_bn"}
    _assert_same_function_without_removed_bns(model, lean)


def test_mobilenetv2_loses_expansion_bns_and_head_bn():
    model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10)
    _randomize_bns(model)
    lean = LessBN(model, fn_flag=True)
    report = lean.less_bn_report
    names = _bn_names(model)
    assert (len(names), report.num_removed, report.num_kept) == (52, 17, 35)
    assert report.removed == {
        **{n: "expansion" for n in names if n.endswith("_expand_BN")},
        "Conv_1_bn": "head",
    }
    assert set(report.kept) == {"bn_Conv1"} | {n for n in names if re.search(r"_(depthwise|project)_BN$", n)}
    assert isinstance(lean.get_layer("predictions"), FNHead)
    _assert_kept_weights_equal(model, lean)
    assert np.all(np.isfinite(lean(X32)))
    # the body is the same function: the head's input (the pooled features, spread ~1.7) agrees
    _assert_same_function_without_removed_bns(model, lean, output="predictions")


def test_densenet121_loses_one_bn_per_dense_layer_and_transition_bns():
    model = keras.applications.DenseNet121(weights=None, input_shape=(32, 32, 3), classes=10)
    lean = LessBN(model)
    report = lean.less_bn_report
    names = _bn_names(model)
    assert (len(names), report.num_removed, report.num_kept) == (121, 61, 60)
    first_layers = {f"conv{s}_block1_1_bn" for s in range(2, 6)}
    dense_input = {n for n in names if n.endswith("_0_bn") and "_block1_" not in n}
    transitions = {"pool2_bn", "pool3_bn", "pool4_bn"}
    assert len(dense_input) == 54
    assert report.removed == {
        n: "dense-first-layer" if n in first_layers else "dense-input"
        for n in names if n in first_layers | dense_input | transitions
    }
    assert {"conv1_bn", "bn"} <= set(report.kept)
    _assert_same_function_without_removed_bns(model, lean)


# ------------------------------------------------------------------ validation

class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_subclassed_model_is_rejected():
    model = _Subclassed()
    model(np.ones((1, 3), np.float32))
    with pytest.raises(TypeError, match="LessBN needs a functional or Sequential model"):
        LessBN(model)


@pytest.mark.parametrize("not_a_model", [keras.layers.Dense(2), "resnet50", None])
def test_non_model_is_rejected(not_a_model):
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        LessBN(not_a_model)


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_fn_flag_must_be_bool(flag):
    with pytest.raises(TypeError, match="`fn_flag` must be a bool"):
        LessBN(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), fn_flag=flag)


def test_unbuilt_sequential_is_rejected():
    with pytest.raises(ValueError, match="has no defined input"):
        LessBN(keras.Sequential([keras.layers.Dense(2)]))


def test_fn_flag_without_dense_output_is_rejected():
    inputs = keras.Input((4, 4, 3))
    model = keras.Model(inputs, keras.layers.Conv2D(2, 1)(inputs))
    with pytest.raises(ValueError, match="fn_flag=True needs a Dense layer"):
        LessBN(model, fn_flag=True)


def test_a_levels_lessbn_warning_points_at_the_users_boostmodel_call():
    from keras_boost import BoostModel

    inputs = keras.Input((6,))
    with pytest.warns(UserWarning, match="found no BatchNormalization layer to remove") as caught:
        BoostModel(inputs, keras.layers.Dense(3)(inputs), boost_level="O1")
    assert [w.filename for w in caught if "BatchNormalization" in str(w.message)] == [__file__]


def test_a_warning_names_the_nested_model_whose_batchnorms_lessbn_cannot_see(resnet50):
    inputs = keras.Input((32, 32, 3))
    nested = keras.Model(inputs, keras.layers.Dense(2)(resnet50[0](inputs)))
    with pytest.warns(UserWarning, match=r"nested model 'resnet50' \(53 BatchNormalization layers\) is one opaque "
                                         r"layer to LessBN.*input_tensor="):
        assert LessBN(nested).less_bn_report.num_removed == 0
    inline = keras.applications.ResNet50(weights=None, include_top=False, input_tensor=keras.Input((32, 32, 3)))
    assert LessBN(keras.Model(inline.input, inline.output)).less_bn_report.num_removed > 0  # the advice works


class _NoConfig(keras.layers.Layer):
    """A keras-io style custom layer: its own arguments, no get_config, no **kwargs."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def call(self, x):
        return x * self.scale


def _transfer_model():
    """The keras-io transfer-learning shape: a nested base (frozen), a custom layer, a residual block, a head."""
    base = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, padding="same"), BN(),
                             keras.layers.ReLU()], name="base")
    base.trainable = False
    inputs = keras.Input((8, 8, 3))
    h = _conv_bn_relu(_NoConfig(0.5)(base(inputs, training=False)), 4, 3, "stem")
    y = _conv_bn_relu(h, 4, 3, "a")
    y = BN(name="b_bn")(keras.layers.Conv2D(4, 3, padding="same", name="b_conv")(y))
    h = keras.layers.Add()([h, y])
    head = keras.layers.Dense(3, name="head")
    return base, head, inputs, head(keras.layers.GlobalAveragePooling2D()(h))


def test_a_boost_level_trains_the_users_own_layers():
    from keras_boost import BoostModel

    base, head, inputs, outputs = _transfer_model()
    model = BoostModel(inputs, outputs, boost_level="O1")
    assert model.less_bn_report.num_removed == 1  # a_bn: the residual branch keeps its last BN
    kept = [layer for layer in model.layers if not isinstance(layer, (keras.layers.InputLayer, FNHead))]
    assert any(layer is base for layer in kept)  # the user's objects, not copies
    frozen = len(model.trainable_weights)
    base.trainable = True  # the keras-io fine-tuning step, on the user's reference
    assert len(model.trainable_weights) == frozen + 4  # the base's conv kernel, bias, BN gamma, beta
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).random((16, 8, 8, 3), dtype=np.float32)
    kernel = base.layers[0].kernel.numpy().copy()
    model.fit(x, np.arange(16) % 3, batch_size=8, epochs=1, verbose=0)
    assert not np.array_equal(base.layers[0].kernel.numpy(), kernel)  # fit trained the user's base


def test_a_layer_that_cannot_be_copied_is_named_with_what_to_do():
    _, _, inputs, outputs = _transfer_model()
    with pytest.raises(TypeError, match=r"(?s)layer '.*' \(_NoConfig\) cannot be rebuilt from its config.*"
                                        r"share_layers=True"):
        LessBN(keras.Model(inputs, outputs))
    shared = LessBN(keras.Model(inputs, outputs), share_layers=True)
    assert shared.less_bn_report.num_removed == 1
    with pytest.raises(TypeError, match="`share_layers` must be a bool"):
        LessBN(keras.Model(inputs, outputs), share_layers="yes")


def test_batchnorms_that_hold_what_they_learnt_are_kept():
    from keras_boost import BoostModel
    from keras_boost.app.demo_net import demo_resnet

    fresh = LessBN(demo_resnet(model_class=keras.Model)).less_bn_report
    assert fresh.num_removed == 5 and fresh.held == {}
    # "pretrained": one step of plain Keras moves every BatchNorm's moving statistics
    base = demo_resnet(model_class=keras.Model)
    base.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).random((8, 28, 28, 1), dtype=np.float32)
    base.fit(x, np.arange(8) % 10, batch_size=8, epochs=1, verbose=0)
    with pytest.warns(UserWarning, match=r"LessBN kept 5 BatchNormalization layers .* that its rules would remove, "
                                         r"because they hold what they learnt \(moving statistics no longer"):
        model = BoostModel(base.inputs, base.outputs, boost_level="O1")
    report = model.less_bn_report
    assert report.num_removed == 0 and set(report.held) == set(fresh.removed)
    assert set(report.held.values()) == {"trained"} and set(report.held) <= set(report.kept)
    # the same function (same layers, same order; two compiled graphs, so within float rounding)
    np.testing.assert_allclose(model.predict(x, verbose=0), base.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    # frozen: trainable=False, with statistics still new
    frozen = demo_resnet(model_class=keras.Model)
    for layer in frozen.layers:
        if isinstance(layer, BN):
            layer.trainable = False
    with pytest.warns(UserWarning, match=r"frozen: trainable=False"):
        held = LessBN(frozen).less_bn_report.held
    assert held == {name: "frozen" for name in fresh.removed}


# ---------------------------------------------------------------- models with several outputs
def _two_headed(model_class=keras.Model, second="attr", **kwargs):
    """Dict inputs (an image and a vector) and dict outputs: a softmax classifier 'cls' and either a
    sigmoid attribute 'attr' (a classifier too) or a Dense(1) regression 'reg'."""
    keras.utils.set_random_seed(4)
    image, aux = keras.Input((8, 8, 1), name="image"), keras.Input((3,), name="aux")
    x = image
    for i in range(3):
        x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name=f"conv{i}")(x)
        x = BN(name=f"bn{i}")(x)
        x = keras.layers.ReLU(name=f"relu{i}")(x)
    x = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling2D()(x), aux])
    activation = "sigmoid" if second == "attr" else None
    outputs = {"cls": keras.layers.Dense(3, activation="softmax", name="cls")(x),
               second: keras.layers.Dense(1, activation=activation, name=second)(x)}
    return model_class({"image": image, "aux": aux}, outputs, **kwargs)


def _two_headed_data(second="attr", n=64):
    rng = np.random.default_rng(5)
    x = {"image": rng.normal(size=(n, 8, 8, 1)).astype(np.float32), "aux": rng.normal(size=(n, 3)).astype(np.float32)}
    y = {"cls": rng.integers(0, 3, n), second: (x["aux"][:, :1] > 0) * 1.0 if second == "attr" else x["aux"][:, :1]}
    return x, y


def _compile_two_headed(model, second="attr"):
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss={"cls": "sparse_categorical_crossentropy", second: "binary_crossentropy" if second == "attr"
                        else "mse"},
                  loss_weights={"cls": 1.0, second: 0.5}, metrics={"cls": ["accuracy"], second: ["mae"]})


def test_a_level_keeps_the_users_output_structure_and_names(tmp_path):
    # Found trying a two-headed model at O1: the rewritten graph's outputs were a flat list, and the
    # FN heads' new Activations renamed the outputs ('cls' -> 'cls_activation'), so compile's loss
    # dict no longer matched (ValueError in fit), and predict returned a list.
    x, y = _two_headed_data()
    plain = _two_headed()
    boosted = _two_headed(BoostModel, boost_level="O1")
    assert boosted.less_bn_report.num_removed >= 1 and sorted(boosted.less_bn_report.fn_heads) == ["attr", "cls"]
    assert boosted.output_names == plain.output_names == ["attr", "cls"]
    for model in (plain, boosted):
        _compile_two_headed(model)
    history = {type(m).__name__: m.fit(x, y, batch_size=16, epochs=1, verbose=0).history for m in (plain, boosted)}
    assert set(history["BoostModel"]) - {"freeze_group"} == set(history["Functional"])
    predicted = boosted.predict(x, verbose=0)
    assert isinstance(predicted, dict) and {k: v.shape for k, v in predicted.items()} == {"cls": (64, 3), "attr": (64, 1)}
    np.testing.assert_allclose(predicted["cls"].sum(axis=1), 1.0, rtol=1e-5)  # the softmax stays after the FN head
    path = tmp_path / "two_headed.keras"
    boosted.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.output_names == ["attr", "cls"]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0)["attr"], predicted["attr"])
    assert set(loaded.fit(x, y, batch_size=16, epochs=1, verbose=0).history) == set(history["BoostModel"])


def test_list_outputs_with_losses_keyed_by_layer_name_at_a_level():
    # Keras' trainer accepts a dict of losses keyed by output layer names for list outputs
    # (keras/src/models/model_test.py: test_functional_list_outputs_dict_losses).
    x, y = _two_headed_data()
    dict_model = _two_headed()
    model = BoostModel(dict_model.inputs, [dict_model.output["cls"], dict_model.output["attr"]], boost_level="O1")
    assert model.output_names == ["cls", "attr"] and model.less_bn_report.fn_heads
    _compile_two_headed(model)
    history = model.fit(x, [y["cls"], y["attr"]], batch_size=16, epochs=1, verbose=0).history
    assert {"cls_accuracy", "attr_mae", "cls_loss", "attr_loss"} <= set(history)


def test_a_level_keeps_every_batchnorm_when_an_output_is_not_a_classifier():
    # Found on a two-headed model at O1: with a BatchNorm removed (and GC), its Dense(1) regression's loss
    # was 6x plain Keras' (docs/less_bn.md); no FN head can make up for the BatchNorms there.
    with pytest.warns(UserWarning, match=r"kept every BatchNormalization.*'reg' come from no classifier Dense") as w:
        model = _two_headed(BoostModel, second="reg", boost_level="O1")
    assert w[0].filename == __file__
    report = model.less_bn_report
    assert report.num_removed == 0 and report.fn_heads == () and report.not_classifiers == ("reg",)
    assert set(report.held.values()) == {"output"} and "not from a classifier Dense: reg" in report.summary()
    assert _bn_names(model) == ["bn0", "bn1", "bn2"]
    _compile_two_headed(model, "reg")
    x, y = _two_headed_data("reg")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not model.boost_step.stage("gradient_centralization").is_on()  # GC makes up for removed BatchNorms: none removed
    forced = _two_headed(BoostModel, second="reg", boost_level="O1", boost_config={"less_bn": {"fn_flag": True}})
    assert forced.less_bn_report.num_removed >= 1  # the less_bn section given: MindSpore's LessBN
    assert isinstance(forced.get_layer("reg"), FNHead) and isinstance(forced.get_layer("cls"), FNHead)
    standalone = LessBN(_two_headed(second="reg"), fn_flag=True)  # MindSpore's: every Dense producing an output
    assert isinstance(standalone.get_layer("reg"), FNHead) and standalone.output_names == ["cls", "reg"]
    with pytest.raises(ValueError, match="fn_outputs"):
        LessBN(_two_headed(), fn_flag=True, fn_outputs="regressions")


@pytest.mark.parametrize("loss", ["mse", keras.losses.Huber(), keras.losses.mean_absolute_error, {"box": "mae"}, ["mse"]],
                         ids=["mse", "Huber", "mae-function", "dict", "list"])
def test_a_regression_loss_on_an_fn_head_is_named_at_compile(loss):
    keras.utils.set_random_seed(6)
    inputs = keras.Input((8, 8, 1))
    x = inputs
    for _ in range(3):
        x = keras.layers.ReLU()(BN()(keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(x)))
    outputs = keras.layers.Dense(4, name="box")(keras.layers.GlobalAveragePooling2D()(x))
    model = BoostModel(inputs, outputs, boost_level="O1")
    assert model.less_bn_report.fn_heads == ("box",)
    with pytest.warns(UserWarning, match=r"output 'box'.*FN head.*'less_bn': False") as caught:
        model.compile("sgd", loss)
    assert caught[0].filename == __file__  # at the user's compile line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.compile("sgd", "categorical_crossentropy")  # a classifier's loss: no warning
        without_head = BoostModel(inputs, outputs, boost_level="O1",
                                  boost_config={"boost": {"mode": "manual", "less_bn": False}})  # the advice
        assert without_head.less_bn_report is None
        without_head.compile("sgd", loss)


def test_a_level_on_an_application_whose_classifier_is_a_convolution():
    # keras.applications' MobileNet and MobileNetV3 end in a 1x1 convolution, a reshape and a softmax:
    # no Dense for the FN head. Until December 5, 2026 a level raised LessBN's ValueError
    # ("fn_flag=True needs a Dense layer producing an output") at BoostModel(...).
    base = keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), classes=10)
    with pytest.warns(UserWarning, match=r"kept every BatchNormalization.*'predictions' come from no classifier Dense"):
        model = BoostModel(base.inputs, base.outputs, boost_level="O1")
    assert model.less_bn_report.num_removed == 0 and model.less_bn_report.fn_heads == ()
    assert len(_bn_names(model)) == len(_bn_names(base)) == 34
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(8, 32, 32, 3)).astype(np.float32)
    np.testing.assert_allclose(model.predict(x, verbose=0), base.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
