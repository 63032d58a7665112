"""Every Examples block of MindSpore's mindspore.boost API document, in its Keras form.

The document is /work/shared/reference/mindspore-boost-api.txt. Where MindSpore has a
`WithLossCell(net, loss_fn)` the Keras form is the model and `loss_fn=`; `nn.Momentum(lr,
momentum=0.9)` is `keras.optimizers.SGD(lr, momentum=0.9)`. Each example must train
(weights change, loss finite), and where `BoostModel.fit` can do the same, both paths give
the same weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_boost as kb
from tests.helpers import max_diff, weights

SIZE, IN_FEATURES, OUT_FEATURES = 16, 16, 10


def matmul_net(in_features=IN_FEATURES, out_features=OUT_FEATURES, two_weights=False, model_class=keras.Model):
    """MindSpore's example `Net`: output = x @ weight (+ x @ weight2), weights all ones."""
    x = keras.Input((in_features,))
    out = keras.layers.Dense(out_features, use_bias=False, kernel_initializer="ones", name="weight")(x)
    if two_weights:
        out2 = keras.layers.Dense(out_features, use_bias=False, kernel_initializer="ones", name="weight2")(x)
        out = keras.layers.Add()([out, out2])
    return model_class(x, out, name="net")


def classifier(seed=0, model_class=keras.Model, depth=4):
    """A small Dense network with a softmax-logit head (the `Net()` of the first example)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((8,))
    h = x
    for i in range(depth):
        h = keras.layers.Dense(16, activation="tanh", name=f"hidden{i}")(h)
    return model_class(x, keras.layers.Dense(4, name="logits")(h), name="net")


def data(n=32, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = keras.utils.to_categorical(np.argmax(x @ rng.normal(size=(8, 4)), axis=1), 4).astype(np.float32)
    return x, y


def momentum():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def as_boost_model(model):
    """A BoostModel over a copy of `model`'s graph and weights (the BoostModel.fit path)."""
    twin = kb.BoostModel(model.inputs, model.outputs, name="twin")
    clone = keras.models.clone_model(twin)
    twin = kb.BoostModel(clone.inputs, clone.outputs, name="twin")
    twin.set_weights(model.get_weights())
    return twin


def fit_full_batch(model, x, y, steps, **compile_args):
    model.fit(x, y, batch_size=len(x), epochs=steps, shuffle=False, verbose=0)
    return model


def assert_trains(before, model, losses):
    assert all(np.isfinite(float(np.asarray(loss))) for loss in losses)
    assert max_diff(before, weights(model)) > 1e-4


# ------------------------------------------------------------ BoostTrainOneStepCell
def test_boost_train_one_step_cell_with_loss_cell():
    """#1) Using the WithLossCell existing provide: train_net = BoostTrainOneStepCell(loss_net, optim)."""
    net = classifier()
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)  # SoftmaxCrossEntropyWithLogits
    twin = as_boost_model(net)
    train_net = kb.BoostTrainOneStep(net, momentum(), loss_fn=loss_fn)
    x, y = data()
    before = weights(net)
    losses = [train_net(x, y) for _ in range(3)]
    assert_trains(before, net, losses)
    twin.compile(optimizer=momentum(), loss=loss_fn)
    fit_full_batch(twin, x, y, 3)
    assert max_diff(weights(net), weights(twin)) < 1e-5


def test_boost_train_one_step_cell_with_user_defined_loss_cell():
    """#2) MyWithLossCell: construct(x, y, label) = loss_fn(backbone(x, y), label)."""
    keras.utils.set_random_seed(3)
    a, b = keras.Input((8,)), keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh")(keras.layers.Concatenate()([a, b]))
    net = keras.Model([a, b], keras.layers.Dense(4)(hidden))
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
    twin = as_boost_model(net)
    x, label = data()
    inputs = (x, x[::-1].copy())
    train_net = kb.BoostTrainOneStep(net, momentum(), loss_fn=loss_fn)
    before = weights(net)
    losses = [train_net(inputs, label) for _ in range(3)]
    assert_trains(before, net, losses)
    twin.compile(optimizer=momentum(), loss=loss_fn)
    twin.fit(inputs, label, batch_size=len(x), epochs=3, shuffle=False, verbose=0)
    assert max_diff(weights(net), weights(twin)) < 1e-5


# ---------------------------------------------------- BoostTrainOneStepWithLossScaleCell
def test_loss_scale_cell_with_update_cell():
    """#1) scale_sense is a Cell: DynamicLossScaleUpdateCell(loss_scale_value=2**12, 2, 1000)."""
    net = matmul_net()
    twin = as_boost_model(net)
    manager = kb.DynamicLossScale(loss_scale_value=2**12, scale_factor=2, scale_window=1000)
    train_network = kb.BoostTrainOneStepWithLossScale(net, momentum(), scale_sense=manager,
                                                      loss_fn=keras.losses.MeanSquaredError())
    inputs = np.ones([OUT_FEATURES, IN_FEATURES], np.float32)
    labels = np.ones([OUT_FEATURES], np.float32)
    before = weights(net)
    loss, overflow, scale = train_network(inputs, labels)
    assert float(scale) == 2.0**12 and not bool(overflow)
    assert_trains(before, net, [loss])
    twin.compile(optimizer=momentum(), loss=keras.losses.MeanSquaredError(),
                 loss_scale=kb.DynamicLossScale(loss_scale_value=2**12, scale_factor=2, scale_window=1000))
    fit_full_batch(twin, inputs, labels, 1)
    assert max_diff(weights(net), weights(twin)) < 1e-5


def test_loss_scale_cell_with_tensor():
    """#2) scale_sense is a Tensor: np.full((1), np.finfo(np.float32).max)."""
    net = matmul_net()
    inputs = np.ones([SIZE, IN_FEATURES], np.float32)
    label = np.zeros([SIZE, OUT_FEATURES], np.float32)
    scaling_sens = tf.constant(np.full((1), np.finfo(np.float32).max), dtype=tf.float32)
    train_network = kb.BoostTrainOneStepWithLossScale(net, momentum(), scale_sense=scaling_sens,
                                                      loss_fn=keras.losses.MeanSquaredError())
    before = weights(net)
    output = train_network(inputs, label)
    assert isinstance(output, tuple) and len(output) == 3
    loss, overflow, scale = output
    assert float(loss) == 256.0 and float(scale) == np.finfo(np.float32).max
    # loss 256 times float32's max overflows: the update is skipped, as in MindSpore.
    assert bool(overflow) and max_diff(before, weights(net)) == 0.0
    train_network.set_sense_scale(tf.constant([1.0]))
    loss, overflow, scale = train_network(inputs, label)
    assert not bool(overflow) and float(scale) == 1.0
    assert_trains(before, net, [loss])


# ----------------------------------------------------------------------- GradientFreeze
def test_gradient_freeze_example_end_to_end():
    """GradientFreeze(10, 1, 0.5, 2000).freeze_generate(network, optimizer), then the cell trains."""
    network = classifier(depth=10)
    twin, plain = as_boost_model(network), as_boost_model(network)
    x, y = data()
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
    gradient_freeze_class = kb.GradientFreeze(10, 1, 0.5, 2000)
    network, optimizer = gradient_freeze_class.freeze_generate(network, momentum())
    assert isinstance(optimizer, kb.FreezeOpt) and isinstance(optimizer, keras.optimizers.Optimizer)
    train_net = kb.BoostTrainOneStep(network, optimizer, loss_fn=loss_fn)
    before = weights(network)
    losses = [train_net(x, y) for _ in range(6)]
    assert_trains(before, network, losses)
    assert int(train_net.stage("gradient_freeze").position.numpy()) == 6
    sequence = gradient_freeze_class.generate_freeze_index_sequence()
    assert sorted(set(sequence[:6].tolist())) != [0]  # some of the six steps were partial

    # The BoostModel.fit path with the FreezeOpt as its optimizer: the same weights.
    _, twin_opt = gradient_freeze_class.freeze_generate(twin, momentum())
    twin.compile(optimizer=twin_opt, loss=loss_fn)
    fit_full_batch(twin, x, y, 6)
    assert max_diff(weights(network), weights(twin)) < 1e-5

    # A plain keras.Model compiled with the FreezeOpt applies the same schedule.
    plain = keras.Model(plain.inputs, plain.outputs)
    _, plain_opt = gradient_freeze_class.freeze_generate(plain, momentum())
    plain.compile(optimizer=plain_opt, loss=loss_fn)
    fit_full_batch(plain, x, y, 6)
    assert max_diff(weights(network), weights(plain)) < 1e-5


# ------------------------------------------------------------------------------- LessBN
def test_less_bn_example():
    """network = boost.LessBN(network)."""
    from tests.test_less_bn import residual_cnn

    keras.utils.set_random_seed(0)
    network = kb.LessBN(residual_cnn())
    assert network.less_bn_report.num_removed >= 1
    network.compile(optimizer=momentum(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 16, 16, 3)).astype(np.float32), rng.integers(0, 10, 8)
    before = weights(network)
    history = network.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert_trains(before, network, history.history["loss"])


# --------------------------------------------------------------------- OptimizerProcess
def test_optimizer_process_example_centralizes_on_a_plain_keras_model():
    """add_grad_centralization(network); optimizer = generate_new_optimizer(); any Keras model."""
    network = matmul_net()
    optimizer = momentum()
    optimizer_process = kb.OptimizerProcess(optimizer)
    optimizer_process.add_grad_centralization(network)
    optimizer = optimizer_process.generate_new_optimizer()
    assert isinstance(optimizer, kb.optimizers.CentralizedOptimizer)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SIZE, IN_FEATURES)).astype(np.float32)
    y = rng.normal(size=(SIZE, OUT_FEATURES)).astype(np.float32)
    w0 = network.get_weights()[0]
    grad = 2.0 * x.T @ (x @ w0 - y) / (SIZE * OUT_FEATURES)  # d mean((xW - y)^2) / dW, NumPy
    centred = grad - grad.mean(axis=0, keepdims=True)  # Keras (in, out): centre over all but the last axis
    network.compile(optimizer=optimizer, loss="mse")  # a plain keras.Model
    network.fit(x, y, batch_size=SIZE, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(network.get_weights()[0], w0 - 0.1 * centred, rtol=1e-5, atol=1e-6)
    assert np.abs(centred - grad).max() > 1e-3  # the centring is visible


# --------------------------------------------------------------------- ParameterProcess
def test_parameter_process_example():
    """group_params = parameter_process.generate_group_params(new_parameter, net.trainable_params())."""
    network = matmul_net(two_weights=True)
    new_parameter = network.trainable_variables[:1]
    parameter_process = kb.ParameterProcess()
    group_params = parameter_process.generate_group_params(new_parameter, network.trainable_variables)
    assert group_params == [new_parameter]  # a flat original list: one group of all new parameters
    groups = parameter_process.assign_parameter_group(network.trainable_variables)  # split at len // 2
    assert [[v.path for v in g] for g in groups] == [["weight/kernel"], ["weight2/kernel"]]


# ------------------------------------------------------- the names without an example
def test_adasum_called_directly_builds_itself():
    """AdaSum(rank, device_number, group_number, parameter_tuple)(delta_weights, parameters, old)."""
    network = matmul_net()
    parameters = network.trainable_variables
    old = [tf.identity(v) for v in parameters]
    delta = [tf.fill(v.shape, 0.25) for v in parameters]
    adasum = kb.AdaSum(0, 1, 1, parameters)
    result = adasum(delta, parameters, old)
    assert result is parameters and adasum.built
    np.testing.assert_allclose(parameters[0].numpy(), np.full((IN_FEATURES, OUT_FEATURES), 0.75))


def test_gradient_accumulation_called_as_a_cell_equals_one_large_batch():
    """GradientAccumulation(max_accumulation_step, optimizer)(loss, grads)."""
    net, big = classifier(), classifier()
    x, y = data(32)
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
    optimizer = momentum()
    optimizer.build(net.trainable_variables)
    accumulation = kb.GradientAccumulation(4, optimizer)

    @tf.function
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, net(xb, training=True))
        return accumulation(loss, tape.gradient(loss, net.trainable_variables))

    before = weights(net)
    losses = [micro_step(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    assert_trains(before, net, losses)
    assert int(optimizer.iterations.numpy()) == 1
    big.compile(optimizer=momentum(), loss=loss_fn)
    big.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert max_diff(weights(net), weights(big)) < 1e-5


def test_auto_boost_example_flow():
    """AutoBoost(level, kwargs).network_auto_process_train / _eval, as Model(boost_level=...) uses them."""
    auto = kb.AutoBoost("O1", boost_config_dict={"grad_freeze": {"total_steps": 20}})
    network = classifier()
    model, optimizer = auto.network_auto_process_train(network, momentum())
    model.compile(optimizer=optimizer, loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    x, y = data()
    before = weights(model)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert_trains(before, model, history.history["loss"])
    eval_network = auto.network_auto_process_eval(network)
    np.testing.assert_array_equal(eval_network.predict(x, verbose=0), model.predict(x, verbose=0))
