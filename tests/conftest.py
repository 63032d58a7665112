import ast
import os
import re

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


# ------------------------------------------------------------------ the two phases
# `./scripts/test.sh` runs the suite in two phases: the tests that stay in this process, two at
# a time (pytest-xdist; most of their time is single-threaded Python and tracing), then the
# tests that launch workers, hosts or a scheduler, one at a time: they share the cluster of
# namespace hosts, take links down, and bound how soon a fault ends a job. Such a test is marked
# `launches`: its function, a fixture it asks for, or a function of its module it names
# (transitively) runs horovodrun, mpirun or `keras-boost ... --np/--hosts`, or uses
# tests/launch.py, tests/cluster.py or tests/slurm.py.
LAUNCHING = re.compile(r"tests\.launch|tests\.cluster|tests\.slurm|\bhorovodrun\b|\bmpirun\b|--np\b|--hosts\b")
LAUNCHING_MODULES = ("tests.launch", "tests.cluster", "tests.slurm")
LAUNCHING_FIXTURES = {"cluster", "slurm", "readme_cluster"}


def launching_names(source):
    """The names in a test module's `source` that launch: its functions (tests, fixtures, helpers) whose
    text launches or names one that does, and what it imports from the launching helper modules."""
    tree = ast.parse(source)
    names = set(LAUNCHING_FIXTURES)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in LAUNCHING_MODULES:
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "tests":
            names.update(alias.asname or alias.name for alias in node.names
                         if f"tests.{alias.name}" in LAUNCHING_MODULES)
    texts = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            texts[node.name] = texts.get(node.name, "") + "\n" + ast.get_source_segment(source, node)
    pending = {name: text for name, text in texts.items() if name not in names}
    while True:
        found = {name for name, text in pending.items() if LAUNCHING.search(text)
                 or set(re.findall(r"\b\w+\b", text)) & names}
        if not found:
            return names
        names |= found
        for name in found:
            del pending[name]


def pytest_configure(config):
    config.addinivalue_line("markers", "launches: the test launches workers, hosts or a scheduler "
                                       "(./scripts/test.sh runs these one at a time, after the others)")


def pytest_collection_modifyitems(config, items):
    per_module = {}
    for item in items:
        path = str(item.path)
        if path not in per_module:
            with open(path, encoding="utf-8") as handle:
                per_module[path] = launching_names(handle.read())
        names = per_module[path]
        function = getattr(item, "originalname", None) or item.name
        if function in names or names & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launches)
