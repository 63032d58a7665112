"""The versions keras_boost supports, stated once.

    python3 keras_boost/_versions.py default       the TensorFlow scripts/setup.sh installs by default
    python3 keras_boost/_versions.py tested        the TensorFlow versions the suite runs on, oldest first
    python3 keras_boost/_versions.py check 2.19.1  exit 1, saying why, outside the supported range

`setup.py`, `scripts/setup.sh` (the default TensorFlow), `import keras_boost`,
`keras-boost info` and `keras-boost build-horovod` all read this file, and a test checks the
versions table of docs/getting-started.md against it and against what is installed. This
module imports nothing but the standard library, so that setup.py and the Horovod build can
read it before TensorFlow or Keras is installed.
"""

# TensorFlow minor versions [lower, upper): every one of them passes the whole suite.
SUPPORTED_TENSORFLOW = ((2, 18), (2, 22))
# The release of each supported minor version that the suite runs on.
TESTED_TENSORFLOW = ("2.18.1", "2.19.1", "2.20.0", "2.21.0")
# What ./scripts/setup.sh installs when TF_VERSION is not set: the newest tested.
DEFAULT_TENSORFLOW = "2.21.0"

SUPPORTED_KERAS = ((3, 15), (3, 16))
TESTED_KERAS = "3.15.1"

# Horovod's last release, built from its sdist with the patches in keras_boost/horovod_patches.
HOROVOD = "0.28.1"

TESTED_PYTHON = "3.11"

# numpy as each TensorFlow pulls it (TensorFlow's own requirement decides; keras_boost only
# states the envelope): 2.18 needs numpy < 2.1, 2.19 installs 2.1.x, 2.20 and 2.21 2.4.x.
NUMPY = ">=1.26,<3"


def version_tuple(version, parts=2):
    """(major, minor[, ...]) of a version string such as '2.21.0rc1' or '3.15.1.dev0'."""
    numbers = []
    for piece in str(version).split(".")[:parts]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        numbers.append(int(digits or 0))
    return tuple(numbers)


def _range_text(bounds):
    (lo_major, lo_minor), (hi_major, hi_minor) = bounds
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


TENSORFLOW_RANGE = _range_text(SUPPORTED_TENSORFLOW)
KERAS_RANGE = _range_text(SUPPORTED_KERAS)


def tensorflow_problem(version):
    """None when TensorFlow `version` is supported, else a sentence that says what to install."""
    low, high = SUPPORTED_TENSORFLOW
    if low <= version_tuple(version) < high:
        return None
    return (f"keras_boost supports TensorFlow {TENSORFLOW_RANGE} (tested with {', '.join(TESTED_TENSORFLOW)}); "
            f"this environment has TensorFlow {version}. Install a supported version, e.g. "
            f"pip install 'tensorflow-cpu=={DEFAULT_TENSORFLOW}' (or 'tensorflow[and-cuda]=={DEFAULT_TENSORFLOW}' "
            f"on a GPU machine), then build Horovod for it: keras-boost build-horovod.")


def keras_problem(version):
    """None when Keras `version` is supported, else a sentence that says what to install."""
    low, high = SUPPORTED_KERAS
    if low <= version_tuple(version) < high:
        return None
    return (f"keras_boost supports Keras {KERAS_RANGE} (tested with {TESTED_KERAS}); this environment has "
            f"Keras {version}. Install a supported version, e.g. pip install 'keras{KERAS_RANGE}'.")


if __name__ == "__main__":  # scripts/setup.sh, before any environment exists
    import sys

    if sys.argv[1:] == ["default"]:
        print(DEFAULT_TENSORFLOW)
    elif sys.argv[1:] == ["tested"]:
        print(" ".join(TESTED_TENSORFLOW))
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        if tensorflow_problem(sys.argv[2]):
            sys.exit(f"TF_VERSION={sys.argv[2]}: keras_boost supports TensorFlow {TENSORFLOW_RANGE}; set TF_VERSION "
                     f"to one of {', '.join(TESTED_TENSORFLOW)}, or leave it unset for {DEFAULT_TENSORFLOW}")
        if sys.argv[2] not in TESTED_TENSORFLOW:
            print(f"TensorFlow {sys.argv[2]} is in the supported range but the suite runs on "
                  f"{', '.join(TESTED_TENSORFLOW)}")
    else:
        sys.exit("usage: _versions.py default | tested | check VERSION")
