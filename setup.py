import os

from setuptools import find_packages, setup

# The supported versions, stated once (keras_boost/_versions.py imports only the standard library).
_versions = {}
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_boost", "_versions.py")) as f:
    exec(f.read(), _versions)

setup(
    name="keras_boost",
    version="0.1.0",
    description="MindSpore-style boost features (loss scaling, accumulation, freezing, LessBN, AdaSum) "
    "for Keras 3 on TensorFlow, distributed with Horovod.",
    packages=find_packages(include=["keras_boost", "keras_boost.*"]),
    package_data={"keras_boost": ["horovod_patches/*.patch"]},
    python_requires=">=3.10",
    # TensorFlow itself is an extra: `tensorflow`, `tensorflow-cpu` and `tensorflow[and-cuda]` are
    # different distributions, and requiring one would install it beside the one a user has.
    # `import keras_boost` checks the installed TensorFlow against the range.
    install_requires=[f"keras{_versions['KERAS_RANGE']}", f"numpy{_versions['NUMPY']}", "tensorboard"],
    extras_require={
        "cpu": [f"tensorflow-cpu{_versions['TENSORFLOW_RANGE']}"],
        "gpu": [f"tensorflow[and-cuda]{_versions['TENSORFLOW_RANGE']}"],
        # Horovod: `keras-boost build-horovod` builds the patched release for the TensorFlow installed
        "horovod": ["mpi4py"],
        "test": ["pytest", "pytest-timeout", "hypothesis"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["keras-boost=keras_boost.app.cli:main"]},
)
