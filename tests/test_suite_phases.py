"""The suite's two phases (tests/conftest.py, scripts/test.sh): the tests that launch workers, hosts or a
scheduler are found and marked `launches`, so that they run one at a time after the in-process tests."""

import ast
from pathlib import Path

from tests.conftest import launching_names

TESTS = Path(__file__).resolve().parent

MODULE = '''
import subprocess
from tests.launch import shared as shared_launch

def _job(args):
    return subprocess.run(["horovodrun", "-np", "2", *args])

def _twice(args):
    return [_job(args), _job(args)]

def _cli(*args):
    return subprocess.run(["keras-boost", "train", *args])

def test_by_helper():
    _twice([])

def test_by_import():
    shared_launch("gloo", "topology")

def test_on_hosts(cluster):
    pass

def test_cli_on_two_workers():
    _cli("--np", "2")

def test_cli_alone():
    _cli("--epochs", "1")

def test_numpy_only():
    assert 1 + 1 == 2
'''


def test_a_test_launches_through_its_helpers_imports_and_fixtures():
    names = launching_names(MODULE)
    assert {"test_by_helper", "test_by_import", "test_on_hosts", "test_cli_on_two_workers"} <= names
    assert not {"test_cli_alone", "test_numpy_only", "_cli"} & names


def test_every_test_of_the_launching_modules_is_marked():
    for name in ("test_multihost.py", "test_slurm.py", "test_never_hang.py", "test_multiprocess.py",
                 "test_accumulation_multiprocess.py", "test_dropin_multiprocess.py"):
        source = (TESTS / name).read_text()
        tests = {node.name for node in ast.parse(source).body
                 if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
        assert tests and tests <= launching_names(source), (name, sorted(tests - launching_names(source)))
