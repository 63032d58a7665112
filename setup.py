from setuptools import find_packages, setup

setup(
    name="keras_boost",
    version="0.1.0",
    description="MindSpore-style boost features (loss scaling, accumulation, freezing, LessBN, AdaSum) "
    "for Keras 3 on TensorFlow, distributed with Horovod.",
    packages=find_packages(include=["keras_boost", "keras_boost.*"]),
    python_requires=">=3.10",
    install_requires=["tensorflow-cpu==2.18.1", "keras>=3.15,<3.16", "numpy<2.1"],
    extras_require={
        "horovod": ["horovod==0.28.1", "mpi4py"],
        "test": ["pytest", "pytest-timeout", "hypothesis"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["keras-boost=keras_boost.app.cli:main"]},
)
