"""Gradient freeze, the pure parts: groups, index sequences, FreezeOpt and the plan."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost.config import DEFAULTS
from keras_boost.stages import freeze
from keras_boost.stages.freeze import (
    FreezeOpt,
    GradientFreeze,
    freeze_cell,
    frozen_share,
    generate_freeze_index_sequence,
    split_parameters_groups,
)


def mindspore_sequence(groups, strategy, p, total_steps):
    """MindSpore's algorithm step by step, on the global NumPy RNG (seed it first)."""
    length = int(total_steps * 1.01)
    if groups <= 1:
        return [0] * length
    if strategy == 0:
        pattern = [0] * int(p * (groups - 1) // (1 - p) + 0.5) + list(range(1, groups))
        out = []
        while len(out) < length:
            out += pattern
        return out
    indices = list(range(1, groups))
    prob = [i / sum(indices) for i in indices]
    out, full, partial = [0], 1, 0
    while len(out) < length:
        if partial / (full + partial) < 1 - p:
            out.append(int(np.random.choice(indices[::-1], p=prob)))
            partial += 1
        else:
            out.append(0)
            full += 1
    return out


# --- index sequences ---------------------------------------------------------------


@pytest.mark.parametrize("strategy", [0, 1])
@pytest.mark.parametrize("groups,p,total", [(10, 0.7, 1000), (4, 0.5, 333), (7, 0.9, 50)])
def test_sequence_matches_mindspore(strategy, groups, p, total):
    np.random.seed(123)
    expected = mindspore_sequence(groups, strategy, p, total)
    got = generate_freeze_index_sequence(groups, strategy, p, total, seed=123)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_continuous_default_pattern():
    sequence = generate_freeze_index_sequence(10, 0, 0.7, 1000)
    pattern = [0] * 20 + list(range(1, 10))  # z = 20, not 21: 6.3 // 0.30000000000000004
    assert list(sequence[:29]) == pattern
    assert len(sequence) == math.ceil(1010 / 29) * 29  # whole patterns, not cut at T=1010
    np.testing.assert_array_equal(sequence, np.tile(pattern, len(sequence) // 29))
    assert np.mean(sequence == 0) == pytest.approx(20 / 29)


def test_interval_length_and_full_share():
    sequence = generate_freeze_index_sequence(10, 1, 0.7, 5000, seed=7)
    assert len(sequence) == int(5000 * 1.01)
    assert sequence[0] == 0
    assert np.mean(sequence == 0) == pytest.approx(0.7, abs=1 / len(sequence))


def test_interval_running_partial_share_stays_below_one_minus_p():
    p = 0.7
    sequence = generate_freeze_index_sequence(10, 1, p, 3000, seed=1)
    n = np.arange(1, len(sequence) + 1)
    running = np.cumsum(sequence != 0) / n
    assert np.all(running <= 1 - p + 1 / n)


def test_interval_group_distribution():
    groups = 10
    sequence = generate_freeze_index_sequence(groups, 1, 0.5, 200_000, seed=3)
    partial = sequence[sequence != 0]
    counts = np.bincount(partial, minlength=groups)[1:] / len(partial)
    expected = (groups - np.arange(1, groups)) / (groups * (groups - 1) / 2)
    np.testing.assert_allclose(counts, expected, atol=0.005)


def test_seed_controls_interval_sequence():
    a = generate_freeze_index_sequence(10, 1, 0.7, 2000, seed=5)
    b = generate_freeze_index_sequence(10, 1, 0.7, 2000, seed=5)
    c = generate_freeze_index_sequence(10, 1, 0.7, 2000, seed=6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(a == 0, c == 0)  # only the sampled groups differ


@pytest.mark.parametrize("strategy", [0, 1])
def test_single_group_or_p_one_gives_full_steps(strategy):
    for groups, p in [(1, 0.7), (10, 1.0), (10, 1)]:
        sequence = generate_freeze_index_sequence(groups, strategy, p, 100)
        np.testing.assert_array_equal(sequence, np.zeros(101, np.int32))


@pytest.mark.parametrize("strategy", [2, -1, "1", 1.0, True, None])
def test_unsupported_strategy(strategy):
    with pytest.raises(ValueError, match="Unsupported freezing training strategy"):
        generate_freeze_index_sequence(10, strategy, 0.7, 100)
    with pytest.raises(ValueError, match="Unsupported freezing training strategy"):
        generate_freeze_index_sequence(1, strategy, 0.7, 100)


@pytest.mark.parametrize(
    "kwargs,error,name",
    [
        ({"parameter_groups_number": 0}, ValueError, "parameter_groups_number"),
        ({"parameter_groups_number": 2.0}, TypeError, "parameter_groups_number"),
        ({"parameter_groups_number": True}, TypeError, "parameter_groups_number"),
        ({"freeze_p": 0}, ValueError, "freeze_p"),
        ({"freeze_p": -0.1}, ValueError, "freeze_p"),
        ({"freeze_p": 1.5}, ValueError, "freeze_p"),
        ({"freeze_p": float("nan")}, ValueError, "freeze_p"),
        ({"freeze_p": "0.7"}, TypeError, "freeze_p"),
        ({"freeze_p": False}, TypeError, "freeze_p"),
        ({"total_steps": 0}, ValueError, "total_steps"),
        ({"total_steps": 10.5}, TypeError, "total_steps"),  # 10.0 is accepted (MindSpore passes floats)
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 2**32}, ValueError, "seed"),
        ({"seed": None}, TypeError, "seed"),
    ],
)
def test_sequence_bad_arguments(kwargs, error, name):
    args = {"parameter_groups_number": 10, "freeze_strategy": 1, "freeze_p": 0.7,
            "total_steps": 100}
    args.update(kwargs)
    with pytest.raises(error, match=name):
        generate_freeze_index_sequence(**args)


def test_frozen_share():
    interval = generate_freeze_index_sequence(10, 1, 0.7, 100_000, seed=0)
    continuous = generate_freeze_index_sequence(10, 0, 0.7, 100_000)
    assert frozen_share(interval, 10) == pytest.approx(0.3 * 3.667 / 10, abs=0.003)
    assert frozen_share(continuous, 10) == pytest.approx(45 / 29 / 10)
    assert frozen_share(np.zeros(5, np.int32), 10) == 0.0
    with pytest.raises(ValueError, match="sequence"):
        frozen_share([0, 10], 10)


# --- parameter groups --------------------------------------------------------------


def conv_bn_cnn(blocks=3):
    layers = [keras.Input((8, 8, 1))]
    for i in range(blocks):
        layers += [
            keras.layers.Conv2D(2, 3, padding="same", use_bias=i % 2 == 0),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
        ]
    layers += [keras.layers.Flatten(), keras.layers.Dense(3)]
    return keras.Sequential(layers)


def weights(*layers):
    return [v for layer in layers for v in layer.trainable_variables]


def same(a, b):
    return [id(v) for v in a] == [id(v) for v in b]


def test_groups_are_nested_suffixes_of_conv_bn_blocks():
    model = conv_bn_cnn(3)
    c1, b1, _, c2, b2, _, c3, b3, _, _, dense = model.layers
    blocks = [weights(c1, b1), weights(c2, b2), weights(c3, b3), weights(dense)]
    groups = split_parameters_groups(model, 2)  # stride 2
    assert same(groups[0], model.trainable_variables)
    assert same(groups[1], blocks[2] + blocks[3])
    groups = split_parameters_groups(model, 4)  # stride 1
    for i in range(4):
        assert same(groups[i], sum(blocks[i:], []))
    assert same(groups[1][:3], [c2.kernel, b2.gamma, b2.beta])


def test_more_groups_than_blocks_gives_all_variables():
    model = conv_bn_cnn(1)
    groups = split_parameters_groups(model, 5)  # 2 blocks: stride 0
    assert len(groups) == 5
    for group in groups:
        assert same(group, model.trainable_variables)


def test_functional_forward_order_leading_bn_and_nested_model():
    dense = keras.layers.Dense(2)  # created first, used last
    lead_bn = keras.layers.BatchNormalization()
    conv = keras.layers.Conv2D(2, 3)
    inner_conv, inner_bn = keras.layers.Conv2D(2, 3), keras.layers.LayerNormalization()
    inner = keras.Sequential([inner_conv, inner_bn])
    inputs = keras.Input((8, 8, 1))
    x = inner(conv(lead_bn(inputs)))
    model = keras.Model(inputs, dense(keras.layers.Flatten()(x)))
    groups = split_parameters_groups(model, 3)
    assert same(groups[0], weights(lead_bn, conv, inner_conv, inner_bn, dense))
    assert same(groups[1], weights(inner_conv, inner_bn, dense))
    assert same(groups[2], weights(dense))


def test_frozen_layers_are_left_out():
    model = conv_bn_cnn(2)
    model.layers[0].trainable = False
    groups = split_parameters_groups(model, 1)
    assert same(groups[0], model.trainable_variables)
    assert len(groups[0]) == len(weights(*model.layers[1:]))


@pytest.mark.parametrize("count,error", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                         (True, TypeError), ("3", TypeError)])
def test_split_bad_group_count(count, error):
    with pytest.raises(error, match="freeze_para_groups_number"):
        split_parameters_groups(conv_bn_cnn(1), count)


def test_split_model_without_trainable_variables():
    model = keras.Sequential([keras.Input((3,)), keras.layers.ReLU()])
    with pytest.raises(ValueError, match="model"):
        split_parameters_groups(model, 2)


# --- FreezeOpt ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return conv_bn_cnn(3)


def test_freeze_opt_keeps_optimizer_groups_and_strategy(model):
    sgd = keras.optimizers.SGD(0.1)
    groups = split_parameters_groups(model, 4)
    for strategy in ([0, 3, 1], (0, np.int64(2)), np.array([0, 3], np.int64),
                     tf.constant([1, 2], tf.int32)):
        opt = FreezeOpt(sgd, groups, strategy)
        assert opt.optimizer is sgd and opt.strategy.dtype == np.int32
        np.testing.assert_array_equal(opt.strategy, np.asarray(strategy))
        assert all(same(a, b) for a, b in zip(opt.groups, groups))
    plain = FreezeOpt(sgd)
    assert plain.groups is None and plain.strategy is None


@pytest.mark.parametrize(
    "args,error,match",
    [
        (("sgd", None, None), TypeError, "opt"),
        ((None, None, [0]), ValueError, "train_parameter_groups"),
        ((None, "groups", None), TypeError, "train_parameter_groups"),
        ((None, [], None), ValueError, "train_parameter_groups"),
        ((None, ["w"], None), TypeError, "train_parameter_groups"),
        ((None, [[]], None), ValueError, "train_parameter_groups"),
        ((None, [["w"]], None), TypeError, "train_parameter_groups"),
        ((None, "ok", [0, 1.0]), ValueError, "train_strategy"),
        ((None, "ok", [0, True]), ValueError, "train_strategy"),
        ((None, "ok", np.array([0.0])), ValueError, "train_strategy"),
        ((None, "ok", np.zeros((2, 2), np.int32)), ValueError, "train_strategy"),
        ((None, "ok", tf.constant([0.0])), ValueError, "train_strategy"),
        ((None, "ok", "0101"), TypeError, "train_strategy"),
        ((None, "ok", {0: 1}), TypeError, "train_strategy"),
        ((None, "ok", []), ValueError, "train_strategy"),
        ((None, "ok", [0, 2]), ValueError, "train_strategy"),
        ((None, "ok", [-1]), ValueError, "train_strategy"),
    ],
)
def test_freeze_opt_bad_arguments(model, args, error, match):
    opt, groups, strategy = args
    opt = keras.optimizers.SGD(0.1) if opt is None else opt
    groups = split_parameters_groups(model, 2) if groups == "ok" else groups
    with pytest.raises(error, match=match):
        FreezeOpt(opt, groups, strategy)


# --- freeze_cell -------------------------------------------------------------------


def test_freeze_cell_plan(model):
    groups = split_parameters_groups(model, 4)
    plan = freeze_cell(model, FreezeOpt(keras.optimizers.SGD(0.1), groups, [0, 2, 3]))
    trainable = model.trainable_variables
    assert len(plan.branches) == 4
    for group, branch in zip(groups, plan.branches):
        assert same(branch.variables, group)
        assert same([trainable[i] for i in branch.indices], group)
    assert plan.branches[0].indices == tuple(range(len(trainable)))
    assert plan.period == 3 and [plan.group_at(s) for s in range(5)] == [0, 2, 3, 0, 2]


def test_freeze_cell_defaults_round_robin_and_single_group(model):
    groups = split_parameters_groups(model, 3)
    plan = freeze_cell(model, FreezeOpt(keras.optimizers.SGD(0.1), groups))
    assert [plan.group_at(s) for s in range(4)] == [0, 1, 2, 0]
    plan = freeze_cell(model, FreezeOpt(keras.optimizers.SGD(0.1)))
    assert len(plan.branches) == 1 and plan.period == 1
    assert same(plan.branches[0].variables, model.trainable_variables)


def test_freeze_cell_bad_arguments(model):
    with pytest.raises(TypeError, match="freeze_opt"):
        freeze_cell(model, keras.optimizers.SGD(0.1))
    other = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = FreezeOpt(keras.optimizers.SGD(0.1), [other.trainable_variables])
    with pytest.raises(ValueError, match="not trainable variables of `model`"):
        freeze_cell(model, opt)
    twice = [model.trainable_variables[:1] * 2]
    with pytest.raises(ValueError, match="more than once"):
        freeze_cell(model, FreezeOpt(keras.optimizers.SGD(0.1), twice))


# --- GradientFreeze ----------------------------------------------------------------


def test_gradient_freeze_generate(model):
    sgd = keras.optimizers.SGD(0.1)
    boost = GradientFreeze(param_groups=4, freeze_type=1, freeze_p=0.7, total_steps=500, seed=9)
    same_model, opt = boost.freeze_generate(model, sgd)
    assert same_model is model and opt.optimizer is sgd
    expected = split_parameters_groups(model, 4)
    assert all(same(a, b) for a, b in zip(opt.groups, expected))
    np.testing.assert_array_equal(
        opt.strategy, generate_freeze_index_sequence(4, 1, 0.7, 500, seed=9)
    )
    np.testing.assert_array_equal(
        boost.generate_freeze_index_sequence(10, 0, 0.5, 20),
        generate_freeze_index_sequence(10, 0, 0.5, 20),
    )
    assert len(boost.split_parameters_groups(model)) == 4


def test_gradient_freeze_defaults_and_config():
    boost = GradientFreeze()
    config = boost.get_config()
    assert config == {"param_groups": 4, "freeze_type": 0, "freeze_p": 0.7,
                      "total_steps": 65536, "seed": 0}
    assert config == DEFAULTS["grad_freeze"]  # the class and AutoBoost's O1 agree
    assert GradientFreeze.from_config(config).get_config() == config
    assert freeze.CONTINUOUS_STRATEGY == 0 and freeze.INTERVAL_STRATEGY == 1


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"param_groups": 0}, ValueError, "param_groups"),
        ({"param_groups": [1, 2]}, TypeError, "param_groups"),
        ({"param_groups": True}, TypeError, "param_groups"),
        ({"freeze_type": 2}, ValueError, "freeze_type"),
        ({"freeze_p": 0.0}, ValueError, "freeze_p"),
        ({"freeze_p": None}, TypeError, "freeze_p"),
        ({"total_steps": -5}, ValueError, "total_steps"),
        ({"total_steps": "100"}, TypeError, "total_steps"),
        ({"seed": 1.0}, TypeError, "seed"),
        ({"seed": -3}, ValueError, "seed"),
    ],
)
def test_gradient_freeze_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientFreeze(**kwargs)


@pytest.mark.parametrize("kind", ["keras.Model", "BoostModel"])
def test_freeze_opt_leaves_the_frozen_variables_and_their_momentum_untouched(kind):
    """A step that trains group 1 changes neither group 0's weights nor group 0's momentum slots
    (a zero gradient fed to a frozen variable would decay its momentum and move it)."""
    from keras_boost import BoostModel
    from tests.helpers import classification_data, mlp

    net = mlp(BoostModel if kind == "BoostModel" else keras.Model)
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    variables = net.trainable_variables
    groups = [variables[:2], variables[2:]]
    net.compile(optimizer=FreezeOpt(sgd, groups, [0, 1]),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = classification_data(n=32, seed=5)
    net.train_on_batch(x[:16], y[:16])  # step 1 trains group 0: its momentum is not zero now

    def frozen():
        return ([v.numpy().copy() for v in groups[0]],
                [sgd.momentums[sgd._get_variable_index(v)].numpy().copy() for v in groups[0]])

    weights_before, momentum_before = frozen()
    assert all(np.abs(m).max() > 0 for m in momentum_before)
    trained_before = [v.numpy().copy() for v in groups[1]]
    net.train_on_batch(x[16:], y[16:])  # step 2 trains group 1 alone
    weights_after, momentum_after = frozen()
    for before, after in zip(weights_before + momentum_before, weights_after + momentum_after):
        np.testing.assert_array_equal(before, after)
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(trained_before, groups[1]))  # group 1 did train
