"""AdaSum combine math: the pair rule, the tree, and both backends across processes."""

import numpy as np
import pytest
import tensorflow as tf

from keras_boost.stages import adasum_ops
from keras_boost.stages.adasum_ops import adasum_pair, adasum_tree, combine, exact_adasum_allreduce


def np_pair(a, b, eps=0.0):
    dot, anorm, bnorm = a @ b + eps, a @ a + eps, b @ b + eps
    acoeff = 1.0 - dot / anorm / 2 if anorm > 0 else 1.0
    bcoeff = 1.0 - dot / bnorm / 2 if bnorm > 0 else 1.0
    return acoeff * a + bcoeff * b


def np_tree(rows):
    if len(rows) == 1:
        return rows[0]
    half = (len(rows) + 1) // 2
    return np_pair(np_tree(rows[:half]), np_tree(rows[half:]))


def test_pair_orthogonal_is_sum_and_equal_is_one():
    a, b = tf.constant([1.0, 0.0, 0.0]), tf.constant([0.0, 2.0, 0.0])
    np.testing.assert_allclose(adasum_pair(a, b), [1.0, 2.0, 0.0])
    np.testing.assert_array_equal(adasum_pair(a * 3, a * 3), a * 3)


def test_pair_zero_input_gives_other_like_horovod():
    b = tf.constant([[0.5, -1.5], [2.0, 0.25]])
    np.testing.assert_array_equal(adasum_pair(tf.zeros_like(b), b), b)
    np.testing.assert_array_equal(adasum_pair(b, tf.zeros_like(b)), b)
    np.testing.assert_array_equal(adasum_pair(tf.zeros_like(b), tf.zeros_like(b)), tf.zeros_like(b))


@pytest.mark.parametrize("eps", [0.0, 1e-12])
def test_pair_random_matches_numpy(eps):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 6, 7)) * 1e-6 + rng.normal(size=(6, 7)) * 1e-6
    got = adasum_pair(tf.constant(a, tf.float32), tf.constant(b, tf.float32), eps=eps)
    assert got.dtype == tf.float32 and got.shape == (6, 7)
    expected = np_pair(np.ravel(a.astype(np.float32)).astype(np.float64),
                       np.ravel(b.astype(np.float32)).astype(np.float64), eps)
    np.testing.assert_allclose(np.ravel(got), expected, rtol=1e-5, atol=1e-12)


def test_pair_accumulates_float32_in_float64():
    # 2^20 random float32 values: the result is the float64 rule rounded once to float32
    # (within one ulp). Random terms hide a float32 accumulation (its coefficient error,
    # ~5e-8, stays under an ulp); test_pair_of_long_cancelling_vectors_is_exact catches it.
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(2, 1 << 20)).astype(np.float32)
    got = adasum_pair(tf.constant(a), tf.constant(b)).numpy()
    expected = np_pair(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_max_ulp(got, expected, maxulp=1)


def test_pair_of_long_cancelling_vectors_is_exact():
    # a = [u, u], b = [v, -v] with small integers: the products, the dot product (exactly 0)
    # and both squared norms (< 2^53) are exact in float64, so AdaSum returns a + b exactly.
    # In float32 the running sums pass 2^24 and lose their low bits: the dot product comes out
    # non-zero (measured with segment_sum in float32: 32444 instead of 0, a coefficient of
    # 0.99961 instead of 1).
    rng = np.random.default_rng(5)
    u = rng.integers(1, 8, size=1 << 20).astype(np.float32)
    v = rng.integers(500, 1000, size=1 << 20).astype(np.float32)
    a, b = np.concatenate([u, u]), np.concatenate([v, -v])
    assert (a.astype(np.float64) @ b.astype(np.float64)) == 0.0
    got = adasum_pair(tf.constant(a), tf.constant(b)).numpy()
    np.testing.assert_array_equal(got, a + b)
    got_tree = adasum_tree([tf.constant(a), tf.constant(b)]).numpy()
    np.testing.assert_array_equal(got_tree, a + b)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_tree_matches_numpy_rule(n):
    rng = np.random.default_rng(n)
    rows = rng.normal(size=(n, 3, 5)) + rng.normal(size=(3, 5))
    got = adasum_tree([tf.constant(r, tf.float64) for r in rows])
    np.testing.assert_allclose(got, np.reshape(np_tree([np.ravel(r) for r in rows]), (3, 5)),
                               rtol=1e-12)


def test_tree_shape_for_non_power_of_two():
    g = [tf.constant(v) for v in np.random.default_rng(2).normal(size=(5, 4))]
    left = adasum_pair(adasum_pair(g[0], g[1]), g[2])
    np.testing.assert_array_equal(adasum_tree(g), adasum_pair(left, adasum_pair(g[3], g[4])))
    np.testing.assert_array_equal(adasum_tree(g[:3]), left)


def test_tree_orthogonal_sums_and_identical_stays():
    eye = [tf.constant(row) for row in np.eye(5, dtype=np.float32)]
    np.testing.assert_allclose(adasum_tree(eye), np.ones(5), rtol=1e-6)
    same = [tf.constant([1.0, -2.0, 3.0])] * 3
    np.testing.assert_array_equal(adasum_tree(same), same[0])


@pytest.mark.parametrize("shape", [(1,), (1, 1), ()])
def test_tree_averages_single_element_tensors(shape):
    values = [0.0, 1.0, 5.0]
    got = adasum_tree([tf.fill(shape, v) for v in values])
    assert got.shape == shape
    np.testing.assert_allclose(got, np.full(shape, 2.0))


def test_tree_compiles_in_tf_function():
    rows = [tf.constant(r, tf.float32) for r in np.random.default_rng(3).normal(size=(3, 2, 3))]
    compiled = tf.function(lambda *rs: adasum_tree(list(rs)))(*rows)
    np.testing.assert_array_equal(compiled, adasum_tree(rows))


def test_single_process_returns_input():
    tensors = [tf.constant([1.0, 2.0]), tf.constant([[3.0]])]
    for combined in (exact_adasum_allreduce(tensors), combine(tensors)):
        assert all(c is t for c, t in zip(combined, tensors))
    assert adasum_ops.resolve_backend() == adasum_ops.EXACT
    with pytest.raises(ValueError):
        adasum_ops.resolve_backend("fast")


def _horovod(controller):
    hvd = pytest.importorskip("horovod.tensorflow")
    built = hvd.mpi_built() if controller == "mpi" else hvd.gloo_built()
    if not built:
        pytest.skip(f"Horovod built without {controller}")


def _identical(results, key):
    return len({result[key] for result in results.values()}) == 1


@pytest.mark.parametrize("np_", [2, 4])
def test_mpi_native_equals_exact_equals_numpy(np_):
    _horovod("mpi")
    from tests.launch import shared

    # a scenario of the shared MPI launch of np_ workers (the 4-worker one also trains AdaSum)
    results = shared({2: "mpi", 4: "mpi4"}[np_], "adasum_combine")
    for result in results.values():
        assert result["auto_backend"] == "native"
        assert result["eager_equals_graph"] and result["dtypes_kept"]
        assert result["diff_exact"] < 1e-5 and result["diff_native"] < 1e-5
        assert result["diff_raw_native"] < 1e-5 and result["diff_native_exact"] < 1e-6
    assert _identical(results, "exact_hash") and _identical(results, "native_hash")


@pytest.mark.parametrize("np_", [2, 3])
def test_gloo_exact_equals_numpy_and_is_identical(np_):
    _horovod("gloo")
    from tests.launch import run_ok, shared

    if np_ == 2:  # a scenario of the shared Gloo launch
        results = shared("gloo", "adasum_combine")
    else:
        results = run_ok("adasum_combine.py", np=np_, controller="gloo", args=[10 + np_], timeout=120)
    for result in results.values():
        assert result["controller"] == "gloo" and result["auto_backend"] == "exact"
        assert result["eager_equals_graph"] and result["dtypes_kept"]
        assert result["diff_exact"] < 1e-5
    assert _identical(results, "exact_hash")
