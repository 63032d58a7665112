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
