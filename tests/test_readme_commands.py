"""The README's shell commands run as written, from the repository's folder, as a new user types them.

`.venv/` in a command is the environment this suite runs in (`.venv-tf2.18.1/` under
`TF_VERSION=2.18.1 ./scripts/test.sh`), `python` and `horovodrun` are its own (an activated
venv); nothing else of a command is changed. Every command has a timeout.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import horovod_build_env

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _venv_in_root():
    """This suite's environment as a path relative to the repository (a link in it when the venv is elsewhere)."""
    relative = os.path.relpath(sys.prefix, ROOT)
    if not relative.startswith(".."):
        return relative
    link = ROOT / ".venv-readme-test"  # ignored by git, as every .venv*
    if not link.is_symlink():
        link.symlink_to(sys.prefix)
    return link.name


VENV = _venv_in_root()


def as_written(command):
    """`command` from the README with `.venv/` pointing at this suite's environment."""
    return command.replace(".venv/", f"{VENV}/")


def shell(command, timeout, cwd=ROOT, env=None):
    environment = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **(env or {}))
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=timeout)


def readme_command(start):
    """The README's one inline command that starts with `start` (between backquotes)."""
    prose = re.sub(r"^```.*?^```", "", README, flags=re.S | re.M)  # inline commands, not the fenced blocks
    found = [c for c in re.findall(r"`([^`\n]+)`", prose) if c.startswith(start)]
    assert len(set(found)) == 1, (start, found)
    return found[0]


def test_keras_boost_commands():
    assert shell("keras-boost --help", 120).returncode == 0
    info = shell("keras-boost info", 120)
    assert info.returncode == 0 and "Horovod built     mpi, gloo" in info.stdout, info.stdout + info.stderr
    plan = shell("keras-boost build-horovod --print-plan", 120)
    assert plan.returncode == 0 and "wheel cache:" in plan.stdout, plan.stdout + plan.stderr


def test_the_readme_script_on_two_workers(tmp_path):
    """The README's python block as train.py, launched with its horovodrun command."""
    code = re.search(r"^```python\n(.*?)^```", README, re.S | re.M).group(1)
    (tmp_path / "train.py").write_text(code)
    command = readme_command("horovodrun -np 2")
    result = shell(command, 300, cwd=tmp_path, env=horovod_build_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("Epoch 2/2") >= 1, result.stdout[-3000:]


@pytest.fixture
def readme_cluster():
    from tests.cluster import cannot_make_reason

    reason = cannot_make_reason()
    if reason:
        pytest.skip(f"the README's many-hosts commands need network namespaces: {reason}")
    up = shell(readme_command("./scripts/cluster.sh up"), 120)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield
    finally:
        shell("./scripts/cluster.sh down", 120)


def test_the_readme_many_hosts_commands(readme_cluster):
    command = as_written(readme_command("./scripts/cluster.sh run kbh1 --"))
    result = shell(command, 600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test_accuracy" in result.stdout, result.stdout[-3000:]
