import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BOOST_COUNT_COLLECTIVES", "1")  # tests read distributed.allreduce_count()

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

# On a GPU machine the test process must not claim every GPU's memory: the workers it
# launches (horovodrun, mpirun) need those GPUs too.
for _gpu in tf.config.list_physical_devices("GPU"):
    try:
        tf.config.experimental.set_memory_growth(_gpu, True)
    except RuntimeError:  # pragma: no cover - TensorFlow initialised already
        pass


@pytest.fixture(autouse=True)
def _float32_policy():
    """Each test starts from the float32 policy and a fixed seed."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _no_freeze_gate(monkeypatch):
    """In this process, a boost level's freezing is not held back by the gate of
    `keras_boost.step.tuning` (which switches it off in fits too short to repay its
    compilation, as most fits of the tests are, where the groups compile on fit's path:
    on this machine's 2 cores they compile ahead, on one core they would not). The gate's
    own tests turn it on; launched workers run with it, as users do."""
    from keras_boost.step.tuning import SelfMeasurement

    monkeypatch.setattr(SelfMeasurement, "gate", False)


# ------------------------------------------------------------------ the cluster
# Real hosts on this machine (tests/cluster.py): network namespaces with their own
# hostnames, addresses and sshd. Made once per test session by the first test that needs
# it (`cluster` fixture, or a shared launch across hosts in tests/launch.py), removed at the
# end of the session whatever happened; tests that need it skip with the reason where
# namespaces cannot be made (not root).


@pytest.fixture(scope="session")
def cluster():
    from tests import cluster as cluster_module

    made = cluster_module.shared_cluster()
    if made is None:
        pytest.skip(f"multi-host tests need a cluster of network namespaces: {cluster_module.shared_reason()}")
    return made


def pytest_sessionfinish(session, exitstatus):
    from tests import cluster as cluster_module

    cluster_module.shutdown_shared()
