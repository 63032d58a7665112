"""The README's and getting-started's commands run as written, from the repository's folder, as a new
user types them. (getting-started's commands for hosts named `node1`, `host1` and its Slurm commands
run with this machine's hosts in tests/test_cli_hosts.py, tests/test_multihost.py and
tests/test_slurm.py; its install block is what ./scripts/setup.sh does.)

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
GETTING_STARTED = (ROOT / "docs" / "getting-started.md").read_text()


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


def _python_block(text, containing):
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if containing in b]
    assert len(blocks) == 1, (containing, len(blocks))
    return blocks[0]


def test_getting_started_custom_train_step_and_rank_zero_idioms(tmp_path):
    """getting-started's custom `train_step` block and the block that continues it (rank 0 alone
    evaluates, predicts and saves, then a barrier), as one train.py under its own launch line."""
    code = _python_block(GETTING_STARTED, "class MyModel") + _python_block(GETTING_STARTED, "# continues: MyModel")
    (tmp_path / "train.py").write_text(code)
    launch = re.search(r"^(horovodrun -np 2 -H localhost:2 --gloo python train.py)$", GETTING_STARTED, re.M).group(1)
    result = shell(launch, 300, cwd=tmp_path, env=horovod_build_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    evaluated = re.findall(r"\{'accuracy': ([0-9.]+), 'loss': ([0-9.]+)\}", result.stdout)
    assert len(evaluated) == 1 and float(evaluated[0][0]) > 0.75, result.stdout[-3000:]  # rank 0 alone; it learnt
    assert (tmp_path / "model.keras").stat().st_size > 0


def test_getting_started_tf_data_options_block():
    code = _python_block(GETTING_STARTED, "options.autotune.enabled = False")
    result = subprocess.run([sys.executable, "-c", code + "\nprint(sum(1 for _ in dataset))"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.split()[-1] == "4", result.stdout + result.stderr
