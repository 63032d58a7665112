"""Every ```python block of README.md and docs/*.md runs as written (in one process).

Each block runs in a fresh namespace, in its own subprocess-free sandbox: the working
directory is a temporary folder and Fashion-MNIST is cut to its first 512 samples so that
the examples' `fit` calls finish in seconds. A block that needs earlier lines of the same
page says so with `# continues` on its first line and runs after them.
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
            found.append(pytest.param(chain, id=f"{page.name}#{index}"))
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


@pytest.mark.parametrize("code", _blocks())
def test_block_runs(code, small_fashion_mnist, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    keras.utils.set_random_seed(0)
    namespace = {"__name__": "__docs__", "np": np}
    exec(compile(code, "<docs>", "exec"), namespace)  # noqa: S102 - the docs' own examples
