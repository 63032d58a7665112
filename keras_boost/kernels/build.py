"""Builds keras_boost's kernels for the TensorFlow of this Python: `python -m keras_boost.kernels.build`.

Compiles the sources of `keras_boost.kernels` with g++ (TensorFlow's compile and link flags,
`-O3 -ffp-contract=off`: no fused multiply-add, so the kernels round as TensorFlow's own
ops do) into `_keras_boost_kernels.so` beside them, and writes the stamp that `library()`
checks. Does nothing when the library is up to date (`--force` builds anyway). Exits 1 with
the compiler's output when the build fails.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile


def build(force=False, compiler=None):
    import tensorflow as tf

    from keras_boost import kernels

    directory = kernels.directory()
    target = os.path.join(directory, kernels.LIBRARY)
    stamp_path = os.path.join(directory, kernels.STAMP)
    stamp = kernels.stamp()
    if not force and os.path.exists(target) and os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if f.read().strip() == stamp:
                return target, False
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler: install g++ (scripts/setup.sh installs it) or set CXX")
    sources = [os.path.join(directory, name) for name in kernels.SOURCES]
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        output = os.path.join(scratch, kernels.LIBRARY)
        command = ([compiler, "-shared", "-fPIC", "-O3", "-ffp-contract=off", "-fno-math-errno"]
                   + tf.sysconfig.get_compile_flags() + sources + ["-o", output] + tf.sysconfig.get_link_flags())
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"building keras_boost's kernels failed ({' '.join(command)}):\n"
                               f"{result.stdout}{result.stderr}")
        os.replace(output, target)  # atomic: a process loading it sees the old library or the new one
    with open(stamp_path, "w") as f:
        f.write(stamp + "\n")
    return target, True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="build even when the library is up to date")
    args = parser.parse_args(argv)
    try:
        target, built = build(force=args.force)
    except RuntimeError as error:
        print(f"keras_boost kernels: {error}", file=sys.stderr)
        return 1
    print(f"keras_boost kernels: {'built' if built else 'up to date'}: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
