"""Shared by the benchmark scripts: the repository on sys.path, a per-step and a per-epoch timer."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402


class StepTimer(keras.callbacks.Callback):
    """Wall time of every training batch (the first ones include tracing: drop them)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


class EpochTimer(keras.callbacks.Callback):
    """Wall time of every training epoch (validation included when `fit` runs it)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def profiled_ops(logdir):
    """{"<op name>:<op type>": [milliseconds of each run]} of the TensorFlow ops the profiler wrote to `logdir`."""
    import collections
    import glob

    from tensorflow.core.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0], "rb") as f:
        space.ParseFromString(f.read())
    runs = collections.defaultdict(list)
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith("tf_"):
                continue
            for event in line.events:
                name = names.get(event.metadata_id, "")
                if ":" in name and "::" not in name:  # "<op name>:<op type>", not the executor's own events
                    runs[name].append(event.duration_ps / 1e9)
    return runs
