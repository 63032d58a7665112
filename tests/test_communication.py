"""Horovod's fusion/cycle/autotune options of distributed.init, communication(), and the hierarchical allreduce.

The hierarchical allreduce's correctness needs several workers: tests/workers/hierarchical.py
is a scenario of the shared 4-worker launches (MPI and Gloo), which run on 2 hosts of 2
workers of the test cluster (tests/cluster.py), where Horovod's own topology has 2 hosts,
and with hosts given as blocks of 2 ranks (`HierarchicalAllreduce(local_size=2)`).
"""

import math
import os
import types

import keras
import numpy as np
import pytest

from keras_boost import AdaSum, HierarchicalAllreduce, distributed
from keras_boost.step import registry
from tests import launch
from tests.helpers import classification_data, compile_sgd, mlp, weights

VARIABLES = ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG",
             "HOROVOD_ENABLE_XLA_OPS")
_AT_IMPORT = {name: os.environ.get(name) for name in VARIABLES}


@pytest.fixture
def clean_env(monkeypatch):
    """The Horovod variables unset for the test and restored after it, whatever init writes.

    setenv first: monkeypatch restores only what it changed, and deleting an absent
    variable changes nothing, so a variable init sets would outlive the test.
    """
    for name in (*VARIABLES, "HOROVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                 "HOROVOD_STALL_CHECK_TIME_SECONDS", "KERAS_BOOST_STALL_TIMEOUT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


# ----------------------------------------------------------------- options of init
def test_options_become_horovods_variables():
    assert distributed.communication_env() == {}
    assert distributed.communication_env(fusion_threshold_mb=32, cycle_time_ms=2.5, autotune=True,
                                         autotune_log="/tmp/tune.csv") == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_AUTOTUNE_LOG": "/tmp/tune.csv"}
    assert distributed.communication_env(fusion_threshold_mb=0.5)["HOROVOD_FUSION_THRESHOLD"] == "524288"
    assert distributed.communication_env(fusion_threshold_mb=0)["HOROVOD_FUSION_THRESHOLD"] == "0"
    assert distributed.communication_env(cycle_time_ms=0)["HOROVOD_CYCLE_TIME"] == "0.0"
    assert distributed.communication_env(autotune=False) == {"HOROVOD_AUTOTUNE": "0"}


@pytest.mark.parametrize("kwargs, error, message", [
    ({"fusion_threshold_mb": -1}, ValueError, "`fusion_threshold_mb` must be None or a non-negative number"),
    ({"fusion_threshold_mb": math.inf}, ValueError, "got inf (float)"),
    ({"fusion_threshold_mb": math.nan}, ValueError, "got nan (float)"),
    ({"fusion_threshold_mb": "64"}, TypeError, "got '64' (str)"),
    ({"fusion_threshold_mb": True}, TypeError, "got True (bool)"),
    ({"cycle_time_ms": -0.5}, ValueError, "`cycle_time_ms` must be None or a non-negative number (milliseconds)"),
    ({"cycle_time_ms": [1]}, TypeError, "got [1] (list)"),
    ({"autotune": 1}, TypeError, "`autotune` must be None or a bool (True or False), got 1 (int)."),
    ({"autotune": "yes"}, TypeError, "got 'yes' (str)"),
    ({"autotune_log": 3}, TypeError, "`autotune_log` must be None or a file path"),
])
def test_init_rejects_bad_options_without_a_launcher(clean_env, kwargs, error, message):
    with pytest.raises(error) as raised:
        distributed.init(**kwargs)
    assert message in str(raised.value)
    assert not any(name in os.environ for name in VARIABLES)


def test_init_without_a_launcher_only_checks_the_options(clean_env):
    distributed.init(fusion_threshold_mb=16, cycle_time_ms=3, autotune=True)
    assert not any(name in os.environ for name in VARIABLES)  # no Horovod to configure
    assert distributed.size() == 1


class _FakeHorovod:
    """Records the environment when `init()` runs, as Horovod's C++ side reads it there."""

    def __init__(self):
        self.seen = None

    def init(self, **kwargs):
        self.seen = {name: os.environ.get(name) for name in VARIABLES}

    def local_rank(self):
        return 0

    def local_size(self):
        return 1

    def rank(self):
        return 0

    def size(self):
        return 1

    @staticmethod
    def broadcast_object(obj):  # one worker: rank 0's object is everyone's (`serve_store` at init)
        return obj


def test_init_sets_the_variables_before_horovod_starts(clean_env, monkeypatch):
    fake = _FakeHorovod()
    clean_env.setenv("HOROVOD_CYCLE_TIME", "5")  # what a launcher set: kept when the option is None
    clean_env.setenv("KERAS_BOOST_PIN_GPU", "0")
    monkeypatch.setattr(distributed._state, "initialized", False)
    monkeypatch.setattr(distributed._state, "hvd", None)
    monkeypatch.setattr(distributed._state, "comm", None)
    monkeypatch.setattr(distributed._state, "horovod_env", None)
    monkeypatch.setattr(distributed._state, "stall_timeout", distributed._state.stall_timeout)
    monkeypatch.setattr(distributed.runtime, "launched", lambda: True)
    monkeypatch.setattr(distributed.runtime, "_import_horovod", lambda: fake)
    distributed.init(fusion_threshold_mb=8, autotune=True, autotune_log="tune.csv")
    assert fake.seen == {"HOROVOD_FUSION_THRESHOLD": str(8 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "5",
                         "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "tune.csv", "HOROVOD_ENABLE_XLA_OPS": None}
    in_force = distributed.communication()
    assert in_force["fusion_threshold_bytes"] == 8 * 1024 * 1024 and in_force["fusion_threshold_mb"] == 8.0
    assert in_force["cycle_time_ms"] == 5.0 and in_force["autotune"] and in_force["autotune_log"] == "tune.csv"
    assert in_force["horovod"] and in_force["source"]["fusion_threshold"] == "environment"
    clean_env.setenv("HOROVOD_FUSION_THRESHOLD", "1")  # changed after hvd.init(): not what Horovod uses
    assert distributed.communication()["fusion_threshold_bytes"] == 8 * 1024 * 1024
    distributed.init(fusion_threshold_mb=8)  # the values in force again: fine
    distributed.init()
    with pytest.raises(RuntimeError, match="take effect only in the first init"):
        distributed.init(fusion_threshold_mb=64)
    with pytest.raises(ValueError, match="cycle_time_ms"):  # checked even once initialised
        distributed.init(cycle_time_ms=-1)


# ------------------------------------------------------- dynamic process sets
class _FakeSizedHorovod(_FakeHorovod):
    """Also records HOROVOD_DYNAMIC_PROCESS_SETS at init; a launch of 4 workers, 2 per host."""

    def init(self, **kwargs):
        self.dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS")

    def size(self):
        return 4

    def local_size(self):
        return 2


@pytest.fixture
def fake_launch(clean_env, monkeypatch):
    fake = _FakeSizedHorovod()
    clean_env.setenv("KERAS_BOOST_PIN_GPU", "0")
    for name, value in (("initialized", False), ("hvd", None), ("comm", None), ("horovod_env", None),
                        ("process_sets_wanted", []), ("dynamic_process_sets", False),
                        ("stall_timeout", distributed._state.stall_timeout)):
        monkeypatch.setattr(distributed._state, name, value)
    monkeypatch.setattr(distributed.runtime, "launched", lambda: True)
    monkeypatch.setattr(distributed.runtime, "_import_horovod", lambda: fake)
    import keras_boost.distributed.hosts as hosts

    monkeypatch.setattr(hosts, "check_host_addresses", lambda: None)
    return fake


def test_horovod_starts_without_dynamic_process_sets_unless_a_stage_needs_them(fake_launch):
    distributed.init()
    assert fake_launch.dynamic == "0" and not distributed.dynamic_process_sets()
    # compiled now, AdaSum over groups would register process sets at its first step: refused at compile
    with pytest.raises(ValueError, match=r"AdaSum with groups of several workers .*distributed.init\(process_sets=True\)"):
        AdaSum.from_option(AdaSum(device_number=2), None)
    with pytest.raises(ValueError, match="the hierarchical allreduce registers Horovod process sets"):
        HierarchicalAllreduce.from_option(True, None)
    AdaSum.from_option(AdaSum(device_number=1), None)  # every worker its own group: no process set, no error
    assert not distributed._state.process_sets_wanted
    with pytest.raises(RuntimeError, match="without dynamic process sets; process_sets=True takes effect only"):
        distributed.init(process_sets=True)


def test_a_stage_made_before_horovod_starts_switches_dynamic_process_sets_on(fake_launch):
    AdaSum(device_number=2)  # made, not compiled (a level's validation makes every stage): asks nothing
    assert not distributed._state.process_sets_wanted
    stage = AdaSum.from_option(AdaSum(device_number=2), None)  # compiled before anything starts Horovod
    distributed.init()
    assert fake_launch.dynamic == "1" and distributed.dynamic_process_sets() and stage.device_number == 2
    assert HierarchicalAllreduce.from_option(True, None) is not None  # Horovod runs with them: fine


@pytest.mark.parametrize("env, argument, expected", [
    (None, True, "1"), ("1", None, "1"), ("yes", None, "1"), ("0", None, "0"), ("1", False, "0")])
def test_the_argument_then_the_environment_decide(fake_launch, env, argument, expected):
    if env is not None:  # clean_env (under fake_launch) restores the variable after the test
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = env
    distributed.init(process_sets=argument)
    assert fake_launch.dynamic == expected


def test_process_sets_must_be_a_bool(clean_env):
    with pytest.raises(TypeError, match=r"`process_sets` must be None or a bool \(True or False\), got 'yes' \(str\)"):
        distributed.init(process_sets="yes")


def test_keras_boost_train_asks_for_process_sets_when_the_run_needs_them():
    import argparse

    from keras_boost.app.training import needs_process_sets

    def args(level, **extra):
        return argparse.Namespace(level=level, config=None, **extra)

    assert needs_process_sets(args("O2")) and not needs_process_sets(args("O1")) and not needs_process_sets(args("O0"))
    assert needs_process_sets(args("O0", hierarchical_allreduce=True))


def test_communication_reports_horovods_defaults_and_parses_like_it(clean_env):
    defaults = distributed.communication()
    assert defaults["fusion_threshold_bytes"] == 128 * 1024 * 1024 and defaults["fusion_threshold_mb"] == 128.0
    assert defaults["cycle_time_ms"] == 1.0 and defaults["autotune"] is False and defaults["autotune_log"] is None
    assert defaults["source"] == {"fusion_threshold": "Horovod default", "cycle_time": "Horovod default",
                                  "autotune": "Horovod default"}
    assert defaults["horovod"] is False
    clean_env.setenv("HOROVOD_ENABLE_XLA_OPS", "1")
    assert distributed.communication()["cycle_time_ms"] == 0.0  # Horovod's default under XLA ops
    clean_env.setenv("HOROVOD_FUSION_THRESHOLD", " 67108864")
    clean_env.setenv("HOROVOD_CYCLE_TIME", "2.5ms")  # strtof reads the leading number
    clean_env.setenv("HOROVOD_AUTOTUNE", "0")
    clean_env.setenv("HOROVOD_AUTOTUNE_LOG", "ignored.csv")
    parsed = distributed.communication()
    assert parsed["fusion_threshold_mb"] == 64.0 and parsed["cycle_time_ms"] == 2.5
    assert parsed["autotune"] is False and parsed["autotune_log"] is None
    clean_env.setenv("HOROVOD_FUSION_THRESHOLD", "lots")  # strtol: 0
    assert distributed.communication()["fusion_threshold_bytes"] == 0


# ------------------------------------------------------------- hierarchical stage
@pytest.mark.parametrize("value, error, message", [
    ("yes", TypeError, "`hierarchical_allreduce` must be None, a bool (True or False) or a HierarchicalAllreduce, "
                       "got 'yes' (str)."),
    (1, TypeError, "got 1 (int)"),
])
def test_bad_hierarchical_values_raise_at_compile(value, error, message):
    with pytest.raises(error) as raised:
        compile_sgd(mlp(seed=0), hierarchical_allreduce=value)
    assert message in str(raised.value)


def test_hierarchical_checks_its_local_size():
    with pytest.raises(ValueError, match=r"`local_size` must be None or a positive int, got 0 \(int\)\."):
        HierarchicalAllreduce(local_size=0)
    with pytest.raises(TypeError, match=r"`local_size` must be None or a positive int, got '2' \(str\)\."):
        HierarchicalAllreduce(local_size="2")


def test_hierarchical_and_adasum_both_own_reduce():
    with pytest.raises(ValueError) as raised:
        compile_sgd(mlp(seed=0), hierarchical_allreduce=True, adasum=AdaSum(device_number=1))
    message = str(raised.value)
    assert "`reduce`" in message and "AdaSum" in message and "HierarchicalAllreduce" in message


def test_one_process_hierarchical_equals_the_plain_step_bit_for_bit():
    x, y = classification_data(64)
    plain = compile_sgd(mlp(seed=0))
    plain.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    model = compile_sgd(mlp(seed=0), hierarchical_allreduce=True, compression="float16")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    stage = model.boost_step.stage("hierarchical_allreduce")
    assert isinstance(stage, HierarchicalAllreduce) and stage.plan is None
    for a, b in zip(weights(plain), weights(model)):
        np.testing.assert_array_equal(a, b)


def test_keras_file_round_trip_keeps_the_hierarchical_stage(tmp_path):
    model = compile_sgd(mlp(seed=0), hierarchical_allreduce=HierarchicalAllreduce(local_size=2))
    path = tmp_path / "hierarchical.keras"
    model.save(path)
    stage = keras.models.load_model(path).boost_step.stage("hierarchical_allreduce")
    assert isinstance(stage, HierarchicalAllreduce) and stage.local_size == 2
    restored = registry.deserialize(registry.serialize(HierarchicalAllreduce()))
    assert type(restored) is HierarchicalAllreduce and restored.get_config() == {"local_size": None}


def _fake_topology(monkeypatch, placed, homogeneous=True):
    """distributed's view of a launch: `placed` is every worker's (cross rank, rank, local size)."""
    monkeypatch.setattr(distributed, "size", lambda: len(placed))
    monkeypatch.setattr(distributed, "allgather_object", lambda obj, name: list(placed))
    monkeypatch.setattr(distributed, "cross_rank", lambda: placed[0][0])
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    monkeypatch.setattr(distributed, "local_size", lambda: placed[0][2])
    monkeypatch.setattr(distributed, "is_homogeneous", lambda: homogeneous)


def test_hierarchical_groups_follow_horovods_hosts(monkeypatch):
    # hosts {0, 2} and {1, 3} (ranks placed round robin): groups by cross rank, not by rank blocks
    _fake_topology(monkeypatch, [(0, 0, 2), (1, 1, 2), (0, 2, 2), (1, 3, 2)])
    assert HierarchicalAllreduce().groups() == [[0, 2], [1, 3]]
    assert HierarchicalAllreduce(local_size=2).groups() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match=r"local_size \(3\) must divide the number of workers \(4\)"):
        HierarchicalAllreduce(local_size=3).groups()


def test_hierarchical_refuses_a_heterogeneous_launch(monkeypatch):
    _fake_topology(monkeypatch, [(0, 0, 3), (0, 1, 3), (0, 2, 3), (1, 3, 1)], homogeneous=False)
    with pytest.raises(ValueError, match="same number of workers on every host .* hosts with 1 and 3 workers"):
        HierarchicalAllreduce().groups()


def test_hierarchical_refuses_elastic_training(monkeypatch):
    from keras_boost.distributed import runtime

    monkeypatch.setattr(distributed, "size", lambda: 4)
    monkeypatch.setattr(runtime, "launched", lambda: True)  # as under horovodrun, whose elastic mode sets:
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(ValueError, match="not supported under elastic training"):
        HierarchicalAllreduce(local_size=2).build(types.SimpleNamespace(variables=[]))


def test_the_unit_tests_leave_no_horovod_variable_behind():
    assert {name: os.environ.get(name) for name in VARIABLES} == _AT_IMPORT  # the launches below inherit it


def _check_hierarchical(found, hierarchical_topology):
    values = {rank: found[rank]["hierarchical"] for rank in found}
    assert all("error" not in v for v in values.values()), values
    for rank, v in values.items():
        assert v["size"] == 4
        checks = [("explicit", True), ("topology", hierarchical_topology)]
        for name, hierarchical in checks:
            check = v[name]
            assert check["hierarchical"] is hierarchical, (rank, name, check)
            assert check["identical"], (rank, name)  # every rank got the same bits
            for entry in check["errors"]:
                assert entry["error"] <= entry["tolerance"], (rank, name, entry)
            # hierarchical: 3 collectives for each of float32, float64, float16 and 1 for bfloat16;
            # flat: one fused allreduce per dtype
            assert check["collectives"] == (10 if hierarchical else 4), (rank, name, check)
            assert check["per_host"] == (2 if hierarchical else None)
        training = v["training"]
        assert training["identical"] and training["diff"] < 1e-5 and training["moved"] > 0.01, training


@pytest.mark.parametrize("launch_name", ["mpi4", "gloo4"])
def test_hierarchical_allreduce_on_two_hosts_of_two_workers(launch_name):
    # scenarios of the shared 4-worker launches, across 2 hosts of the test cluster (2 workers
    # each) where namespaces can be made: Horovod's own topology then has 2 hosts of 2; on
    # this machine alone it has 1 host of 4 and falls back to the flat allreduce. Either way
    # local_size=2 runs the three phases over blocks of 2 ranks.
    found = launch.shared(launch_name, "hierarchical")
    found = {rank: {"hierarchical": values} for rank, values in found.items()}
    across_hosts = launch.shared_hosts(launch_name) is not None
    expected = (2, 2) if across_hosts else (4, 1)
    assert all((found[r]["hierarchical"]["local_size"], found[r]["hierarchical"]["cross_size"]) == expected
               for r in found), found
    _check_hierarchical(found, hierarchical_topology=across_hosts)
