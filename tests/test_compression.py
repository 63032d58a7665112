"""Gradient compression (compile(compression=...)): the wire form against NumPy, the hooks, the option.

The 2-worker behaviour (the update equals the NumPy mean of the cast gradients, overflow
decisions under a loss scale, one collective per accumulated update) runs in
tests/workers/compression.py under horovodrun.
"""


import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import GradientCompression, distributed
from keras_boost.stages.compression import compress, decompress, saturation_bound
from keras_boost.step import HOOKS, Stage, registry
from tests import launch
from tests.helpers import classification_data, compile_sgd, mlp, weights

F16_MAX = 65504.0
BF16 = ml_dtypes.bfloat16


def gradients():
    rng = np.random.default_rng(3)
    g32 = (rng.normal(size=(4, 5)) * 100 + 1.0 / 3.0).astype(np.float32)
    g32[0, :5] = [1e6, -1e6, 40000.0, 1e-9, 3e-8]  # beyond the bound, both signs; below float16's resolution
    g32[1, :3] = [np.inf, -np.inf, np.nan]
    g64 = rng.normal(size=(3,)) * 1e5  # float64: cast too
    g16 = np.array([1.5, 70.25], np.float16)  # already 16-bit: untouched
    gint = np.array([3, -7], np.int32)  # not a float: untouched
    return [tf.constant(g32), tf.constant(g64), tf.constant(g16), tf.constant(gint), None]


def numpy_wire(g, dtype, bound):
    """NumPy's cast of a gradient to the wire: finite values clipped to +-bound, inf/nan kept."""
    g = np.asarray(g)
    return np.where(np.isfinite(g), np.clip(g, -bound, bound), g).astype(dtype)


def test_the_hooks_are_part_of_the_contract_in_order():
    assert HOOKS.index("window") < HOOKS.index("encode") < HOOKS.index("reduce") < HOOKS.index("decode") \
        < HOOKS.index("agree_finite")
    assert Stage().encode([1], [0]) == [1] and Stage().decode([2], [0]) == [2]


def test_saturation_bound_is_the_largest_value_whose_float16_sums_stay_finite():
    assert saturation_bound("float16", 1) == F16_MAX
    assert saturation_bound("float16", 2) == 32736.0  # (65504 - 16) / 2 = 32744, rounded down to float16
    assert saturation_bound("float16", 3) == 21824.0
    half_ulp = 16.0  # half the spacing of float16 just below 65504
    for workers in range(1, 9):
        bound = saturation_bound("float16", workers)
        assert np.float16(bound) == bound
        assert workers * bound + (workers - 1) * half_ulp <= F16_MAX
        with np.errstate(over="ignore"):  # above 65504 is inf, which is not safe either
            above = float(np.nextafter(np.float16(bound), np.float16(np.inf)))
        assert workers * above + (workers - 1) * half_ulp > F16_MAX  # the next float16 is not safe
        total = np.float16(0)
        for _ in range(workers):  # float16 arithmetic: rounded after every addition
            total = total + np.float16(bound)
        assert np.isfinite(total)
    # saturating at float16's max is not enough once the wire sums two workers
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.float16(F16_MAX) + np.float16(40000.0))
    bf16_bound = saturation_bound("bfloat16", 2)
    assert float(np.array([bf16_bound]).astype(BF16)[0]) == bf16_bound < float(np.finfo(BF16).max) / 2


def test_compress_float16_matches_numpy_casting():
    grads = gradients()
    wire = compress(grads, "float16", workers=2)
    assert [None if g is None else g.dtype for g in wire] == [tf.float16, tf.float16, tf.float16, tf.int32, None]
    np.testing.assert_array_equal(wire[0].numpy(), numpy_wire(grads[0].numpy(), np.float16, 32736.0))
    np.testing.assert_array_equal(wire[1].numpy(), numpy_wire(grads[1].numpy(), np.float16, 32736.0))
    row = wire[0].numpy()[0]
    assert list(row[:3]) == [32736.0, -32736.0, 32736.0]  # saturated, never inf
    assert row[3] == 0.0 and row[4] != 0.0  # 1e-9 flushes to zero, 3e-8 rounds to the smallest subnormal
    specials = wire[0].numpy()[1, :3]
    assert specials[0] == np.inf and specials[1] == -np.inf and np.isnan(specials[2])  # non-finite stays
    assert wire[2] is grads[2] and wire[3] is grads[3] and wire[4] is None
    back = decompress(wire, [g.dtype if g is not None else None for g in grads])
    assert back[0].dtype == tf.float32 and back[1].dtype == tf.float64 and back[2] is wire[2]
    np.testing.assert_array_equal(back[0].numpy(), numpy_wire(grads[0].numpy(), np.float16, 32736.0)
                                  .astype(np.float32))


def test_compress_bfloat16_matches_numpy_casting():
    grads = gradients()
    bound = saturation_bound("bfloat16", 4)
    wire = compress(grads, "bfloat16", workers=4)
    assert wire[0].dtype == tf.bfloat16 and wire[1].dtype == tf.bfloat16 and wire[2] is grads[2]
    got = wire[0].numpy().astype(np.float32)
    expected = numpy_wire(grads[0].numpy(), BF16, bound).astype(np.float32)
    np.testing.assert_array_equal(got, expected)  # 1e6 and 40000 fit: bfloat16 has float32's range
    assert got[0, 0] == np.float32(np.array([1e6]).astype(BF16)[0]) != 1e6
    assert got[1, 0] == np.inf and got[1, 1] == -np.inf and np.isnan(got[1, 2])
    huge = compress([tf.constant([3.4e38, -np.inf], tf.float32)], "bfloat16", workers=2)[0].numpy().astype(np.float32)
    assert huge[0] == saturation_bound("bfloat16", 2) and huge[1] == -np.inf


def test_indexed_slices_are_cast_by_their_values():
    slices = tf.IndexedSlices(tf.constant([[1.0 / 3.0, 2.0]]), tf.constant([1]), tf.constant([3, 2]))
    wire = compress([slices], "float16", workers=2)[0]
    assert isinstance(wire, tf.IndexedSlices) and wire.values.dtype == tf.float16
    back = decompress([wire], [tf.float32])[0]
    assert back.values.dtype == tf.float32 and back.values.numpy()[0, 0] == np.float32(np.float16(1.0 / 3.0))


def test_the_stage_casts_on_two_workers_and_does_nothing_on_one(monkeypatch):
    stage = GradientCompression("fp16")
    grads = gradients()
    same = stage.encode(grads, list(range(5)))
    assert all(a is b for a, b in zip(same, grads))  # one process: no wire, no cast
    assert all(a is b for a, b in zip(stage.decode(same, list(range(5))), grads))
    monkeypatch.setattr(distributed, "size", lambda: 2)
    wire = stage.encode(grads, list(range(5)))
    assert wire[0].dtype == tf.float16 and wire[1].dtype == tf.float16
    back = stage.decode(wire, list(range(5)))
    assert [None if g is None else g.dtype for g in back] == [tf.float32, tf.float64, tf.float16, tf.int32, None]
    np.testing.assert_array_equal(back[1].numpy(), numpy_wire(grads[1].numpy(), np.float16, 32736.0)
                                  .astype(np.float64))


@pytest.mark.parametrize("compression", ["float16", "bfloat16"])
def test_one_process_with_compression_equals_one_without_bit_for_bit(compression):
    x, y = classification_data(96)
    plain = compile_sgd(mlp(seed=0), loss_scale="dynamic", gradient_accumulation=2)
    plain.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    compressed = compile_sgd(mlp(seed=0), loss_scale="dynamic", gradient_accumulation=2, compression=compression)
    compressed.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert compressed.boost_step.stage("compression").dtype == compression
    for a, b in zip(weights(plain), weights(compressed)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("value, error, allowed", [
    ("int8", ValueError, "got 'int8' (str)"),
    ("float32", ValueError, "got 'float32' (str)"),
    (True, TypeError, "got True (bool)"),
    (16, TypeError, "got 16 (int)"),
    (tf.float16, TypeError, "(DType)"),
])
def test_bad_compression_values_raise_at_compile(value, error, allowed):
    with pytest.raises(error) as raised:
        compile_sgd(mlp(seed=0), compression=value)
    message = str(raised.value)
    assert message.startswith("`compression` must be None, False, 'float16' (or 'fp16'), 'bfloat16' (or 'bf16') or "
                              "a GradientCompression, got ")
    assert allowed in message


def test_the_constructor_checks_its_dtype():
    assert GradientCompression("bf16").dtype == "bfloat16" and GradientCompression().dtype == "float16"
    allowed = "`dtype` must be 'float16' (or 'fp16') or 'bfloat16' (or 'bf16'), got "
    with pytest.raises(ValueError) as raised:
        GradientCompression("int8")
    assert str(raised.value) == allowed + "'int8' (str)."
    with pytest.raises(TypeError) as raised:
        GradientCompression(None)
    assert str(raised.value) == allowed + "None (NoneType)."


@pytest.mark.parametrize("value, dtype", [(None, None), (False, None), ("fp16", "float16"), ("bf16", "bfloat16"),
                                          (GradientCompression("bfloat16"), "bfloat16")])
def test_accepted_values(value, dtype):
    model = compile_sgd(mlp(seed=0), compression=value)
    stage = model.boost_step.stage("compression")
    assert (stage is None) if dtype is None else stage.dtype == dtype


def test_keras_file_round_trip_keeps_the_stage(tmp_path):
    x, y = classification_data(32)
    model = compile_sgd(mlp(seed=0), compression="bfloat16")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.get_compile_config()["boost"]["stages"]["compression"]["config"] == {"dtype": "bfloat16"}
    path = tmp_path / "compressed.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    stage = loaded.boost_step.stage("compression")
    assert isinstance(stage, GradientCompression) and stage.dtype == "bfloat16"
    assert stage is not model.boost_step.stage("compression")
    restored = registry.deserialize(registry.serialize(GradientCompression("float16")))
    assert type(restored) is GradientCompression and restored.get_config() == {"dtype": "float16"}


class _Recorder(Stage):
    """Owns encode/reduce/decode: records their order while tracing and counts the runs of encode."""

    option = "record_communication"

    def __init__(self, zero_in=None):
        self.zero_in = zero_in
        self.order = []
        self.encodes = None

    def build(self, context):
        self.encodes = context.state.add_state("record/encodes", 0, "int64")

    def encode(self, grads, indices):
        self.order.append("encode")
        self.encodes.assign_add(1)
        return [g * 0.0 for g in grads] if self.zero_in == "encode" else grads

    def reduce(self, grads, indices):
        self.order.append("reduce")
        return grads

    def decode(self, grads, indices):
        self.order.append("decode")
        return [g * 0.0 for g in grads] if self.zero_in == "decode" else grads


@pytest.mark.parametrize("zero_in", ["encode", "decode"])
def test_the_step_encodes_before_reduce_and_decodes_after_once_per_update(zero_in):
    x, y = classification_data(64)
    recorder = _Recorder(zero_in)
    model = compile_sgd(mlp(seed=0), lr=0.1, momentum=0.0, gradient_accumulation=2, stages=[recorder])
    start = weights(model)
    for i in range(4):  # 4 micro-batches, windows of 2: 2 updates
        model.train_on_batch(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
    assert recorder.order[:3] == ["encode", "reduce", "decode"]
    assert int(recorder.encodes.numpy()) == 2  # at the window boundary only
    assert int(model.optimizer.iterations.numpy()) == 2
    for a, b in zip(start, weights(model)):  # zero gradients from either hook reach SGD: nothing moves
        np.testing.assert_array_equal(a, b)


def test_two_workers_compress_on_the_wire():
    values = launch.shared("gloo", "compression")  # a scenario of the shared Gloo launch (2 hosts where possible)
    assert all("error" not in v for v in values.values()), values
    for rank, v in values.items():
        assert v["size"] == 2
        for dtype in ("float16", "bfloat16"):
            phase = v[dtype]
            assert phase["diff"] == 0.0, (rank, dtype, phase)  # the NumPy mean of the cast gradients, exactly
            assert phase["float32_gap"] > 1e-5, (rank, dtype, phase)  # and not the float32 mean
            assert phase["collectives"] == phase["updates"] == 3
        large, infinite = v["loss_scale"]["large"], v["loss_scale"]["infinite"]
        assert large["overflow"] == 0 and large["changed"] and large["diff"] == 0.0, large
        assert large["saturated"] == large["bound"] == 32736.0 and large["scale"] == 2.0 ** 15
        assert infinite["overflow"] == 1 and infinite["unchanged"] and infinite["finite"], infinite
        assert infinite["scale"] == 2.0 ** 14
        accumulation = v["accumulation"]
        assert accumulation["diff"] == 0.0 and accumulation["iterations"] == 2
        assert accumulation["collectives"] == accumulation["updates"] == 2  # one per update, not per micro-batch
        freeze = v["freeze"]  # compressed training with freeze groups: close to uncompressed, not equal
        assert 0.0 < freeze["diff"] < 1e-2 and freeze["moved"] > 0.05 and freeze["iterations"] == 6, freeze
    for phase in ("float16", "bfloat16", "loss_scale", "accumulation", "freeze"):
        assert values[0][phase]["digest"] == values[1][phase]["digest"], phase  # bit-identical workers
