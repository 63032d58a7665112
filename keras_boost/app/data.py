"""Fashion-MNIST from the Debian package `dataset-fashion-mnist`, synthetic data, sharding."""

import gzip
import os

import numpy as np

FASHION_MNIST_DIR = os.environ.get("KERAS_BOOST_FASHION_MNIST", "/usr/share/datasets/fashion-mnist")
_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def _read_idx(path, offset):
    with gzip.open(path, "rb") as handle:
        return np.frombuffer(handle.read(), dtype=np.uint8, offset=offset)


def load_fashion_mnist(split="train", directory=None):
    """Returns `(images, labels)`: float32 images in [0, 1] of shape (n, 28, 28, 1), int32 labels.

    Reads the IDX files installed by Debian's `dataset-fashion-mnist` (no download).
    """
    if split not in _FILES:
        raise ValueError(f"split must be one of {sorted(_FILES)}, got {split!r}")
    directory = directory or FASHION_MNIST_DIR
    image_file, label_file = (os.path.join(directory, name) for name in _FILES[split])
    for path in (image_file, label_file):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: install the Debian package dataset-fashion-mnist "
                                    "(./scripts/setup.sh does)")
    images = _read_idx(image_file, 16).reshape(-1, 28, 28, 1).astype(np.float32) / 255.0
    labels = _read_idx(label_file, 8).astype(np.int32)
    return images, labels


def synthetic(n, shape=(28, 28, 1), classes=10, seed=0):
    """Learnable synthetic classification data: each class has its own mean image."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(classes, *shape)).astype(np.float32)
    labels = rng.integers(0, classes, size=n).astype(np.int32)
    images = means[labels] + rng.normal(scale=1.0, size=(n, *shape)).astype(np.float32)
    return images, labels


def shard(arrays, rank, size):
    """The contiguous slice `rank` of `size` of each array (equal sizes; the remainder is dropped)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    n = len(arrays[0]) // size
    return tuple(a[rank * n:(rank + 1) * n] for a in arrays)
