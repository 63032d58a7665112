"""Every ```python block of README.md and docs/*.md runs as written (in one process).

Each block runs in a fresh namespace, in its own subprocess-free sandbox: the working
directory is a temporary folder and Fashion-MNIST is cut to its first 512 samples so that
the examples' `fit` calls finish in seconds. A block that needs earlier lines of the same
page says so with `# continues` on its first line and runs after them: in what the block
before it left (its namespace and folder) when that one ran in this session, else after
the whole chain of blocks it continues, run again.
"""

import pathlib
import re

import keras
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    found = []
    for page in PAGES:
        chain = ""
        for index, match in enumerate(BLOCK.finditer(page.read_text())):
            code = match.group(1)
            chain = chain + "\n" + code if code.startswith("# continues") else code
            found.append(pytest.param(f"{page.name}#{index}", code, chain, id=f"{page.name}#{index}"))
    return found


@pytest.fixture
def small_fashion_mnist(monkeypatch):
    from keras_boost.app import data

    real = data.load_fashion_mnist

    def first_512(split="train", directory=None):
        x, y = real(split, directory)
        return x[:512], y[:512]

    monkeypatch.setattr(data, "load_fashion_mnist", first_512)


def test_the_pages_have_code():
    assert len(_blocks()) >= 10


_LEFT = {}  # the block that ran last in this session: its id -> (namespace, folder)


@pytest.mark.parametrize("block, code, chain", _blocks())
def test_block_runs(block, code, chain, small_fashion_mnist, tmp_path, monkeypatch):
    page, index = block.rsplit("#", 1)
    before = _LEFT.pop(f"{page}#{int(index) - 1}", None)
    _LEFT.clear()
    keras.utils.set_random_seed(0)
    if code.startswith("# continues") and before is not None:  # go on from the block above
        namespace, folder = before
    else:
        namespace, code, folder = {"__name__": "__docs__", "np": np}, chain, str(tmp_path)
    monkeypatch.chdir(folder)
    exec(compile(code, "<docs>", "exec"), namespace)  # noqa: S102 - the docs' own examples
    _LEFT[block] = (namespace, folder)
