"""TensorFlow imported for keras_boost: its version checked, its C++ start-up lines kept quiet.

TensorFlow up to 2.20 logs through its own logger, which honours `TF_CPP_MIN_LOG_LEVEL`.
2.21 logs through abseil, and the lines its libraries write while they load
(the oneDNN notice, the CPU-feature notice) come before abseil is initialised: abseil then
writes every line to stderr whatever the level, after a line saying so. When keras_boost
is the one importing TensorFlow and `TF_CPP_MIN_LOG_LEVEL` asks for quiet, the import runs
with stderr read through a filter that drops exactly the abseil lines below that level (and
abseil's own notice and a notice's continuation line); every other line, Python warnings
included, passes through as it comes. Where TensorFlow is already imported, nothing is
filtered: the levels are then the user's business.
"""

import os
import re
import sys
import threading

from keras_boost._versions import tensorflow_problem

# "I0000 00:00:1796618813.235927    3797 port.cc:153] oneDNN custom operations are on. ..." (before
# abseil is initialised, the seconds field counts from the epoch)
_ABSEIL_LINE = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ \]]+:\d+\] ")
_SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}
_ABSEIL_NOTICE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
# The CPU-feature notice is two lines; the second has no abseil prefix of its own.
_CONTINUATIONS = (b"To enable the following instructions:",)


def min_log_level(environ=None):
    """TF_CPP_MIN_LOG_LEVEL as TensorFlow reads it: 0 (everything) to 3; 0 when unset or not a number."""
    text = (os.environ if environ is None else environ).get("TF_CPP_MIN_LOG_LEVEL", "0").strip()
    return int(text) if text.isdigit() else 0


class LineFilter:
    """Decides, line by line, what of TensorFlow's start-up output to keep at `level`."""

    def __init__(self, level):
        self.level = level
        self._dropped_notice = False

    def keep(self, line):
        stripped = line.rstrip(b"\r\n")
        if stripped == _ABSEIL_NOTICE:
            return self.level == 0
        if self._dropped_notice and stripped.startswith(_CONTINUATIONS):
            return False
        match = _ABSEIL_LINE.match(stripped)
        self._dropped_notice = bool(match) and _SEVERITY[match.group(1)] < self.level
        return not self._dropped_notice


def _pump(read_fd, write_fd, line_filter):
    pending = b""
    with os.fdopen(read_fd, "rb", buffering=0) as source:
        while True:
            chunk = source.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if line_filter.keep(line + b"\n"))
            if kept:
                os.write(write_fd, kept)
    if pending and line_filter.keep(pending):
        os.write(write_fd, pending)


def _import_filtered(level):
    try:
        sys.stderr.flush()
        read_fd, write_fd = os.pipe()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        import tensorflow  # noqa: F401 - no stderr to filter (closed or replaced): import as is
        return
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, saved, LineFilter(level)), daemon=True,
                            name="keras_boost-tf-import-stderr")
    pump.start()
    try:
        import tensorflow  # noqa: F401
    finally:
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved, 2)  # the pipe's last write end closes: the pump reads to its end
        pump.join(timeout=10)
        os.close(saved)


def import_tensorflow():
    """Imports TensorFlow (quietly, see above) and raises ImportError outside the supported range."""
    if "tensorflow" not in sys.modules and min_log_level() > 0:
        _import_filtered(min_log_level())
    import tensorflow as tf

    problem = tensorflow_problem(tf.__version__)
    if problem:
        raise ImportError(problem)
    return tf
