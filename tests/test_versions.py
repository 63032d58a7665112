"""The supported versions: stated once (keras_boost/_versions.py), in the docs' table, enforced at import,
and true of the environment the suite runs in; TensorFlow's start-up lines filtered below the asked level."""

import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_boost import _startup, _versions
from keras_boost.app import horovod_build

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


def versions_table():
    """{first column: [supported, tested, notes]} of docs/getting-started.md's versions table."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    section = text.split("### Versions\n", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in section.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_the_docs_table_says_what_versions_py_says():
    table = versions_table()
    assert table["TensorFlow"][0] == _versions.TENSORFLOW_RANGE
    tested = [v.replace(" (default)", "") for v in table["TensorFlow"][1].split(", ")]
    assert tuple(tested) == _versions.TESTED_TENSORFLOW
    assert f"{_versions.DEFAULT_TENSORFLOW} (default)" in table["TensorFlow"][1]
    assert table["Keras"][:2] == [_versions.KERAS_RANGE, _versions.TESTED_KERAS]
    assert table["Python"][1] == _versions.TESTED_PYTHON
    assert table["Horovod"][0] == _versions.HOROVOD and table["Horovod"][1].startswith(_versions.HOROVOD)
    patches = sorted(path.stem for path in horovod_build.patch_files())
    assert patches and table["Horovod patch"][0].split(", ") == patches


def test_the_installed_versions_are_in_the_table():
    table = versions_table()
    assert tf.__version__ in _versions.TESTED_TENSORFLOW, f"the suite runs on an untested TensorFlow {tf.__version__}"
    assert keras.__version__ == _versions.TESTED_KERAS
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" == _versions.TESTED_PYTHON
    minor = ".".join(tf.__version__.split(".")[:2])
    numpy_cell = table["numpy"][1]
    match = re.search(rf"(\d+\.\d+\.\d+) \(([^)]*\b{re.escape(minor)}\b[^)]*)\)", numpy_cell)
    assert match, f"no numpy version for TensorFlow {minor} in {numpy_cell!r}"
    assert np.__version__ == match.group(1)
    horovod = pytest.importorskip("horovod")
    assert horovod.__version__ == _versions.HOROVOD


def test_setup_py_allows_the_range():
    namespace = {"__file__": str(ROOT / "setup.py")}
    text = (ROOT / "setup.py").read_text()
    exec(compile(text.replace("\nsetup(", "\nSETUP = dict(", 1), "setup.py", "exec"), namespace)
    setup = namespace["SETUP"]
    assert f"keras{_versions.KERAS_RANGE}" in setup["install_requires"]
    assert "tensorboard" in setup["install_requires"]  # tensorflow-cpu 2.21 no longer pulls it in
    assert setup["extras_require"]["cpu"] == [f"tensorflow-cpu{_versions.TENSORFLOW_RANGE}"]
    assert not any(r.startswith("tensorflow") for r in setup["install_requires"])  # no second TensorFlow
    assert "horovod_patches/*.patch" in setup["package_data"]["keras_boost"]


@pytest.mark.parametrize("version, ok", [("2.17.1", False), ("2.18.0", True), ("2.19.1", True), ("2.21.0", True),
                                         ("2.21.0rc1", True), ("2.22.0", False), ("3.0.0", False)])
def test_the_tensorflow_range(version, ok):
    problem = _versions.tensorflow_problem(version)
    assert (problem is None) is ok
    if not ok:
        assert f"keras_boost supports TensorFlow {_versions.TENSORFLOW_RANGE}" in problem
        assert f"this environment has TensorFlow {version}" in problem
        assert f"tensorflow-cpu=={_versions.DEFAULT_TENSORFLOW}" in problem and "keras-boost build-horovod" in problem


def test_import_refuses_a_tensorflow_outside_the_range():
    code = "import tensorflow as tf; tf.__version__ = '2.17.1'; import keras_boost"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 1
    assert "ImportError: keras_boost supports TensorFlow >=2.18,<2.22" in result.stderr
    assert "this environment has TensorFlow 2.17.1" in result.stderr


def test_import_refuses_a_keras_outside_the_range():
    code = "import keras; keras.__version__ = '3.16.0'; import keras_boost"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 1 and "keras_boost supports Keras >=3.15,<3.16" in result.stderr


# What TensorFlow 2.21 writes while its libraries load, before abseil is initialised.
ABSEIL_NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
ONEDNN = (b"I0000 00:00:1796618813.235927    3797 port.cc:153] oneDNN custom operations are on. You may see "
          b"slightly different numerical results.\n")
CPU_GUARD = (b"I0000 00:00:1796618813.270000    3797 cpu_feature_guard.cc:227] This TensorFlow binary is optimized "
             b"to use available CPU instructions in performance-critical operations.\n")
CPU_GUARD_2 = b"To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow.\n"
WARNING = b"W0000 00:00:1796618813.300000    3797 something.cc:12] a warning\n"
ERROR = b"E0000 00:00:1796618813.300000    3797 something.cc:12] an error\n"
PYTHON_WARNING = b"/x/y.py:3: UserWarning: a Python warning\n"


@pytest.mark.parametrize("level, kept", [
    (0, [ABSEIL_NOTICE, ONEDNN, CPU_GUARD, CPU_GUARD_2, WARNING, ERROR, PYTHON_WARNING, CPU_GUARD_2]),
    (1, [WARNING, ERROR, PYTHON_WARNING, CPU_GUARD_2]),
    (2, [ERROR, PYTHON_WARNING, CPU_GUARD_2]),
    (3, [PYTHON_WARNING, CPU_GUARD_2]),
])
def test_the_filter_drops_exactly_the_abseil_lines_below_the_level(level, kept):
    # the last line: a continuation-like line that follows a kept one stays
    lines = [ABSEIL_NOTICE, ONEDNN, CPU_GUARD, CPU_GUARD_2, WARNING, ERROR, PYTHON_WARNING, CPU_GUARD_2]
    line_filter = _startup.LineFilter(level)
    assert [line for line in lines if line_filter.keep(line)] == kept


@pytest.mark.parametrize("text, level", [("2", 2), ("", 0), ("x", 0), (" 3 ", 3)])
def test_min_log_level_reads_the_variable_as_tensorflow_does(text, level):
    assert _startup.min_log_level({"TF_CPP_MIN_LOG_LEVEL": text}) == level


def test_import_prints_nothing_at_level_2_and_keeps_the_users_stderr():
    code = "import sys, keras_boost; print('after import', file=sys.stderr)"
    env = dict(ENV, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stderr == "after import\n", result.stderr


def test_the_level_0_output_is_tensorflows_own():
    """Nothing filtered at level 0: the same lines as importing TensorFlow alone (none on 2.18's own logger)."""
    env = dict(ENV, TF_CPP_MIN_LOG_LEVEL="0", TF_ENABLE_ONEDNN_OPTS="1")
    alone = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True, text=True, env=env,
                           timeout=120).stderr
    ours = subprocess.run([sys.executable, "-c", "import keras_boost"], capture_output=True, text=True, env=env,
                          timeout=120).stderr
    # the times and thread ids differ between runs: abseil's (2.19+), TensorFlow's own logger's (2.18)
    pattern = re.compile(r"^(\w\d{4} \d\d:\d\d:[\d.]+ +\d+ |\d{4}-\d\d-\d\d \d\d:\d\d:[\d.]+: )")
    assert [pattern.sub("", line) for line in ours.splitlines()] == [pattern.sub("", line)
                                                                      for line in alone.splitlines()]
    assert "oneDNN custom operations are on" in alone
