"""The Horovod facade without a launcher: size 1, identity collectives, honest capabilities."""

import numpy as np
import tensorflow as tf

from keras_boost import distributed
def test_single_process_defaults():
    assert not distributed.launched()
    assert (distributed.size(), distributed.rank(), distributed.local_rank(), distributed.local_size()) == (1, 0, 0, 1)
    assert not distributed.is_distributed()


def test_collectives_are_identity_and_uncounted():
    before = distributed.allreduce_count()
    x = tf.constant([1.0, 2.0])
    np.testing.assert_array_equal(distributed.allreduce(x).numpy(), [1.0, 2.0])
    reduced = distributed.grouped_allreduce([x, 2 * x])
    np.testing.assert_array_equal(reduced[1].numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(distributed.allgather(x).numpy(), [1.0, 2.0])
    v = tf.Variable(3.0)
    distributed.broadcast_variables([v])
    assert v.numpy() == 3.0
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    assert distributed.allreduce_count() == before


def test_capabilities_report_the_build():
    caps = distributed.capabilities()
    assert caps["tensorflow"] == tf.__version__
    assert caps["horovod"] == "0.28.1"
    assert caps["mpi_built"] and caps["gloo_built"]
    assert caps["size"] == 1 and caps["controller"] is None and caps["native_adasum"] is False


def test_horovod_module_needs_a_launcher():
    import pytest

    with pytest.raises(RuntimeError, match="launcher"):
        distributed.horovod()
