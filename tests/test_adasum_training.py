"""AdaSum as a stage of the boost step, on real Horovod workers."""

import numpy as np
import pytest

from keras_boost import AdaSum
from tests.helpers import classification_data, compile_sgd, mlp, weights
from tests.launch import shared


@pytest.mark.parametrize("np_, controller, device_number, backend", [
    (2, "gloo", 1, "exact"),
    (4, "mpi", 1, "native"),
    (4, "mpi", 2, "native"),
    (4, "gloo", 2, "exact"),
])
def test_adasum_training(np_, controller, device_number, backend):
    # scenarios of the shared launches (2 Gloo workers; 4 MPI workers, both device numbers in
    # one launch; 4 Gloo workers), across the hosts of the test cluster where it can be made
    launch = {(2, "gloo"): "gloo", (4, "mpi"): "mpi4", (4, "gloo"): "gloo4"}[(np_, controller)]
    found = shared(launch, f"adasum_training_{device_number}")
    for rank in range(np_):
        result = found[rank]
        assert result["backend"] == backend and result["groups"] == np_ // device_number
        assert result["step_diff"] < 1e-5, result
        assert result["losses"][-1] < result["losses"][0]
        assert result["digest"] == found[0]["digest"]


def test_single_process_adasum_is_a_plain_step():
    x, y = classification_data(n=64)
    plain = compile_sgd(mlp())
    boosted = compile_sgd(mlp(), adasum=AdaSum())
    plain.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    boosted.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(weights(plain), weights(boosted)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"device_number": 0}, ValueError, "`device_number` must be None or a positive int, got 0"),
    ({"device_number": 1.5}, TypeError, "`device_number` must be None or a positive int, got 1.5"),
    ({"rank": -1}, ValueError, "`rank` must be None or a non-negative int, got -1"),
    ({"backend": "fast"}, ValueError, "`backend` must be one of"),
    ({"group_number": True}, TypeError, "`group_number` must be None or a positive int, got True"),
])
def test_bad_adasum_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdaSum(**kwargs)


def test_single_process_topology_errors():
    with pytest.raises(ValueError, match=r"device_number \(2\) must divide the number of workers \(1\)"):
        compile_sgd(mlp(), adasum=AdaSum(device_number=2))  # refused at compile, not mid-training
