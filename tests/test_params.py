"""OptimizerProcess and ParameterProcess: GC groups, optimizer rebuild, fusion groups."""

import keras
import numpy as np
import pytest

from keras_boost.stages.centralization import GradientCentralization, gc_variables
from keras_boost.graph.less_bn import LessBN
from keras_boost.mindspore.params import OptimizerProcess, ParameterProcess


def _cnn():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(16, 3, padding="same", name="stem")(inputs)
    x = keras.layers.BatchNormalization(name="stem_bn")(x)
    y = keras.layers.Conv2D(16, 3, padding="same", name="conv_a")(x)
    y = keras.layers.BatchNormalization(name="bn_a")(y)
    y = keras.layers.Conv2D(16, 3, padding="same", name="conv_b")(y)
    y = keras.layers.BatchNormalization(name="bn_b")(y)
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Add()([x, y]))
    return keras.Model(inputs, keras.layers.Dense(4, name="logits")(x))


def _paths(variables):
    return [v.path for v in variables]


# ------------------------------------------------------------------ OptimizerProcess

@pytest.mark.parametrize("opt", ["sgd", None, keras.layers.Dense(2)])
def test_optimizer_process_rejects_non_optimizers(opt):
    with pytest.raises(TypeError, match="`opt` must be a keras.optimizers.Optimizer"):
        OptimizerProcess(opt)


def test_new_optimizer_has_the_class_and_config_and_no_state():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    opt = keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True, weight_decay=1e-4)
    model = _cnn()
    opt.apply([np.zeros(v.shape) for v in model.trainable_variables], model.trainable_variables)
    new = OptimizerProcess(opt).generate_new_optimizer()
    assert type(new) is keras.optimizers.SGD and new is not opt
    assert new.get_config() == opt.get_config()
    assert opt.built and int(opt.iterations) == 1
    assert not new.built and int(new.iterations) == 0


def test_new_optimizer_keeps_a_loss_scale_wrapper():
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=1024.0)
    new = OptimizerProcess(opt).generate_new_optimizer()
    assert isinstance(new, keras.optimizers.LossScaleOptimizer)
    assert isinstance(new.inner_optimizer, keras.optimizers.Adam)
    assert new.get_config() == opt.get_config()


def test_add_grad_centralization_returns_the_stage_over_gc_variables():
    model = _cnn()
    process = OptimizerProcess(keras.optimizers.SGD(0.1))
    stage = process.add_grad_centralization(model, min_channels_multiple=1)
    assert isinstance(stage, GradientCentralization) and stage.min_channels_multiple == 1
    expected = ["stem/kernel", "conv_a/kernel", "conv_b/kernel", "logits/kernel"]
    assert _paths(process.gc_variables) == _paths(stage.variables) == expected
    assert _paths(gc_variables(model)) == expected


def test_fn_head_of_a_less_bn_model_is_left_out_of_gc():
    lean = LessBN(_cnn(), fn_flag=True)
    process = OptimizerProcess(keras.optimizers.SGD(0.1))
    process.add_grad_centralization(lean)
    assert "logits/kernel" not in _paths(process.gc_variables)
    assert _paths(process.gc_variables) == ["stem/kernel", "conv_a/kernel", "conv_b/kernel"]


def test_build_params_dict_maps_each_variable_to_its_innermost_layer():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="inner_dense")], name="inner")
    inputs = keras.Input((4,))
    outer = keras.Model(inputs, keras.layers.Dense(2, name="outer_dense")(inner(inputs)))
    owners = OptimizerProcess.build_params_dict(outer)
    assert {owners[id(v)].name for v in outer.weights} == {"inner_dense", "outer_dense"}
    assert owners[id(inner.layers[0].kernel)] is inner.layers[0]


def test_build_gc_params_group_splits_kernels_from_the_rest():
    model = _cnn()
    params_dict = OptimizerProcess.build_params_dict(model)
    centralized, others = OptimizerProcess.build_gc_params_group(params_dict, model.trainable_variables)
    assert _paths(centralized) == ["stem/kernel", "conv_a/kernel", "conv_b/kernel", "logits/kernel"]
    assert len(centralized) + len(others) == len(model.trainable_variables)
    assert all(not p.endswith("/kernel") for p in _paths(others))


def test_build_gc_params_group_validation():
    model = _cnn()
    params_dict = OptimizerProcess.build_params_dict(model)
    with pytest.raises(ValueError, match="empty parameter list"):
        OptimizerProcess.build_gc_params_group(params_dict, [])
    with pytest.raises(TypeError, match="`parameters` must hold only keras.Variable"):
        OptimizerProcess.build_gc_params_group(params_dict, [np.ones(2)])
    stranger = keras.Variable(np.ones((2, 2)), name="stranger")
    with pytest.raises(ValueError, match="stranger, which no layer in `params_dict` owns"):
        OptimizerProcess.build_gc_params_group(params_dict, [stranger])


# ------------------------------------------------------------------ ParameterProcess

def _variables(count):
    return [keras.Variable(np.zeros(1), name=f"v{i}") for i in range(count)]


def test_default_split_is_at_half():
    variables = _variables(5)
    groups = ParameterProcess.assign_parameter_group(variables)
    assert [len(g) for g in groups] == [2, 3]
    assert [v for g in groups for v in g] == variables


@pytest.mark.parametrize("split_point, sizes", [([2, 4], [2, 2, 2]), (1, [1, 5]), ([], [6]),
                                                ((3,), [3, 3])])
def test_explicit_split_points(split_point, sizes):
    groups = ParameterProcess().assign_parameter_group(_variables(6), split_point)
    assert [len(g) for g in groups] == sizes


def test_single_variable_is_one_group():
    assert [len(g) for g in ParameterProcess.assign_parameter_group(_variables(1))] == [1]


@pytest.mark.parametrize("split_point", [0, 6, [4, 2], [2, 2], [-1], [7]])
def test_split_points_out_of_range_or_unordered_are_rejected(split_point):
    with pytest.raises(ValueError, match=r"strictly increasing indices in \[1, 5\]"):
        ParameterProcess.assign_parameter_group(_variables(6), split_point)


@pytest.mark.parametrize("split_point", ["3", 2.0, True, [1, 2.5], {3}])
def test_split_points_of_wrong_type_are_rejected(split_point):
    with pytest.raises(TypeError, match="`split_point` must be an int or a list of ints"):
        ParameterProcess.assign_parameter_group(_variables(6), split_point)


def test_parameters_validation():
    with pytest.raises(ValueError, match="empty parameter list"):
        ParameterProcess.assign_parameter_group([])
    with pytest.raises(TypeError, match="`parameters` must be a list or tuple"):
        ParameterProcess.assign_parameter_group("weights")
    with pytest.raises(TypeError, match="`parameters` must hold only keras.Variable, got int"):
        ParameterProcess.assign_parameter_group([1, 2])


def test_groups_follow_variables_into_the_less_bn_model():
    model = _cnn()
    groups = ParameterProcess.assign_parameter_group(model.trainable_variables)
    lean = LessBN(model, fn_flag=True)
    new_groups = ParameterProcess.generate_group_params(lean.trainable_variables, groups)
    assert len(new_groups) == 3
    for old, new in zip(groups, new_groups[:2]):
        assert set(_paths(new)) == set(_paths(old)) & set(_paths(lean.trainable_variables))
    assert _paths(new_groups[2]) == ["logits/multiplier"]
    mapped = {p for g in new_groups for p in _paths(g)}
    assert mapped == set(_paths(lean.trainable_variables))
    assert not mapped & {"logits/bias", "bn_a/gamma", "bn_a/beta"}


def test_flat_origin_gives_one_group_of_all_new_variables():
    model = _cnn()
    lean = LessBN(model)
    groups = ParameterProcess.generate_group_params(lean.trainable_variables, model.trainable_variables)
    assert groups == [list(lean.trainable_variables)]


def test_empty_origin_groups_keep_their_place():
    variables = _variables(3)
    groups = ParameterProcess.generate_group_params(variables[:2], [[variables[2]], variables[:2]])
    assert groups == [[], variables[:2]]


def test_origin_params_validation():
    variables = _variables(2)
    with pytest.raises(TypeError, match="`origin_params` must be a list of variables"):
        ParameterProcess.generate_group_params(variables, "groups")
    with pytest.raises(ValueError, match="`origin_params` must not be empty"):
        ParameterProcess.generate_group_params(variables, [])
    with pytest.raises(TypeError, match="got an element of type int"):
        ParameterProcess.generate_group_params(variables, [variables, 3])
    with pytest.raises(ValueError, match="empty parameter list"):
        ParameterProcess.generate_group_params([], [variables])
