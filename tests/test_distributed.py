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
    assert caps["size"] == 1 and caps["controller"] is None
    assert distributed.launch_facts() == {"mpi": False, "nccl": False, "homogeneous": True,
                                          "size": 1, "local_size": 1, "gpu": bool(caps["gpus"])}
    from keras_boost.stages import adasum_ops

    assert adasum_ops.native_adasum_available(1) is False  # Horovod's Adasum needs an MPI launch


def test_horovod_module_needs_a_launcher():
    import pytest

    with pytest.raises(RuntimeError, match="launcher"):
        distributed.horovod()


def test_collective_names_count_per_trace_whatever_another_thread_traces():
    """Two threads trace steps at once (the freeze groups' steps are traced in the background):
    each trace names its collectives 1, 2, 3 from its own start, and eager ones count apart."""
    import threading

    from keras_boost.distributed import collectives

    turn = threading.Barrier(2, timeout=60)
    names = {}

    def trace(key):
        @tf.function(autograph=False)
        def step():
            distributed.start_trace()
            names[key] = []
            for _ in range(3):
                turn.wait()  # the two traces name their collectives in alternation
                names[key].append(collectives._name("allreduce"))
            return tf.constant(0.0)

        step.get_concrete_function()

    eager_before = collectives._name("barrier")
    other = threading.Thread(target=trace, args=("background",))
    other.start()
    trace("main")
    other.join(timeout=60)
    expected = ["keras_boost.allreduce.1", "keras_boost.allreduce.2", "keras_boost.allreduce.3"]
    assert names == {"main": expected, "background": expected}
    index = int(eager_before.rsplit(".", 1)[1])
    assert eager_before.startswith("keras_boost.eager.barrier.")
    assert collectives._name("barrier") == f"keras_boost.eager.barrier.{index + 1}"  # untouched by the traces


def test_the_boost_step_scope_is_per_thread():
    """Tracing the boost step in one thread does not stop another thread's optimizer from averaging."""
    import threading

    inside, looked, seen = threading.Event(), threading.Event(), []

    def look():
        inside.wait(60)
        seen.append(distributed.in_boost_step())
        looked.set()

    other = threading.Thread(target=look)
    other.start()
    with distributed.boost_step_scope():
        assert distributed.in_boost_step()
        inside.set()
        looked.wait(60)
    other.join(timeout=60)
    assert seen == [False] and not distributed.in_boost_step()
