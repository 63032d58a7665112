"""Ends a `fit` whose workers stopped making progress together, naming who is where.

A worker that stops calling collectives (stuck in its input pipeline, in a callback, in a
deadlock of user code) leaves the others waiting in their next allreduce forever. Two
guards end such a job within a bounded time (`distributed.init(stall_timeout=...)`,
`$KERAS_BOOST_STALL_TIMEOUT`, default 600 s, 0: off):

- Horovod's stall inspector (`HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`, set by
  `distributed.init`): on rank 0 it logs the tensor names and the missing ranks, then
  shuts Horovod down, so the waiting workers raise and the launcher ends the job. This
  works under MPI; under Gloo (Horovod 0.28.1) it was seen never to fire.
- `StallWatchdog`, which `BoostModel.fit` adds under a launcher: a daemon thread on every
  worker that tracks where the worker is (`in train step 3 of epoch 1`, counted from 1 as Keras' progress shows them; `in callbacks
  after step 2`, ...). When that has not changed for `stall_timeout` seconds it prints
  one line per rank (its own, and every rank's, read from a key-value store, where each
  worker's thread publishes its position when it changes and every few seconds: the Gloo
  launcher's, else one that rank 0 serves, `distributed.progress_store`)
  naming the ranks that are behind, and ends the process with exit code 75; the
  launcher then ends the job. Under MPI it waits a few seconds longer than Horovod's
  shutdown, so Horovod's own message (which names the missing ranks) comes first.
"""

import json
import os
import socket
import sys
import threading
import time

import keras

from keras_boost import distributed
from keras_boost.distributed.progress_store import ProgressStore

STALL_EXIT_CODE = 75


class _Progress:
    def __init__(self):
        self.lock = threading.Lock()
        self.where = "at the start of fit (the configuration check)"
        self.steps = 0  # train steps started in this fit
        self.since = time.monotonic()
        self.version = 0

    def set(self, where, step_started=False):
        with self.lock:
            self.where = where
            self.steps += int(step_started)
            self.since = time.monotonic()
            self.version += 1

    def read(self):
        with self.lock:
            return self.where, self.steps, self.since, self.version


class StallWatchdog(keras.callbacks.Callback):
    """Ends the process when this worker's position in `fit` has not changed for `timeout` s.

    `BoostModel.fit` adds it under a launcher (first among the callbacks) and stops it when
    `fit` returns or raises. It wraps `model.train_function` for the duration of `fit`, so
    that "in train step k" (input pipeline and collectives) is told apart from "in
    callbacks before/after step k" (user code).

    Args:
        timeout: seconds; default `distributed.stall_timeout()`; 0 disables.
    """

    def __init__(self, timeout=None):
        super().__init__()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout < 0):
            raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")
        self.timeout = timeout
        self._progress = None
        self._stop = None
        self._thread = None
        self._epoch = 0
        self._batch = 0
        self._original_train_function = None

    # ---------------------------------------------------------- callbacks
    def on_train_begin(self, logs=None):
        self.start()
        self._set("in on_train_begin callbacks (the start-of-fit broadcast)")
        self._wrap_train_function()

    def start(self):
        """Starts the thread (`fit` calls it before its first collective; idempotent)."""
        timeout = distributed.stall_timeout() if self.timeout is None else float(self.timeout)
        if timeout <= 0 or distributed.size() == 1 or self._thread is not None:
            return
        self._progress = _Progress()
        self._stop = threading.Event()
        horovod = distributed.horovod()
        mpi = bool(horovod.mpi_enabled())
        # Under MPI Horovod's inspector shuts down first (its message names the missing ranks).
        fire_after = timeout + (distributed.stall_check_seconds(timeout) + 5 if mpi else 0)
        self._thread = threading.Thread(
            target=_watch, args=(self._progress, self._stop, fire_after, timeout, distributed.rank(),
                                 distributed.size(), ProgressStore()),
            name="keras_boost-stall-watchdog", daemon=True)
        self._thread.start()

    def _wrap_train_function(self):
        model, original = self.model, self.model.train_function
        if self._progress is None or original is None or getattr(original, "_keras_boost_watched", False):
            return
        watchdog = self

        def train_function(iterator):
            watchdog._set(f"in train step {watchdog._batch} of epoch {watchdog._epoch} (its input pipeline or "
                          "its collectives)", step_started=True)
            return original(iterator)

        train_function._keras_boost_watched = True
        self._original_train_function = original
        model.train_function = train_function

    def _set(self, where, step_started=False):
        if self._progress is not None:
            self._progress.set(where, step_started)

    def seconds_still(self):
        """Seconds since this worker's position last changed (None when not watching)."""
        return None if self._progress is None else time.monotonic() - self._progress.read()[2]

    # Steps and epochs are named from 1, as Keras' progress lines show them (`Epoch 2/30`, `64/64`).
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._set(f"at the start of epoch {self._epoch}")

    def on_train_batch_begin(self, batch, logs=None):
        self._batch = batch + 1
        self._set(f"in callbacks or user code before train step {self._batch} of epoch {self._epoch}")

    def on_train_batch_end(self, batch, logs=None):
        self._set(f"in callbacks or user code after train step {batch + 1} of epoch {self._epoch}")

    def on_epoch_end(self, epoch, logs=None):
        self._set(f"at the end of epoch {epoch + 1} (validation, epoch-end callbacks)")

    def on_test_begin(self, logs=None):
        self._set(f"in validation after epoch {self._epoch}")

    def on_test_end(self, logs=None):
        self._set(f"after validation of epoch {self._epoch} (metric allreduce, callbacks)")

    def on_train_end(self, logs=None):
        self.stop()

    def stop(self):
        """Stops the thread and unwraps the train function (idempotent; `fit` calls it when it ends)."""
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=5)
        self._progress = self._stop = self._thread = None
        original = getattr(self, "_original_train_function", None)
        if original is not None and self.model is not None and getattr(self.model.train_function,
                                                                       "_keras_boost_watched", False):
            self.model.train_function = original
        self._original_train_function = None


def heartbeat_seconds(fire_after):
    """How often a worker republishes its position even when it has not moved (a sign of life)."""
    return max(1.0, min(10.0, fire_after / 6))


def _watch(progress, stop, fire_after, timeout, rank, size, store):
    poll = max(0.2, min(2.0, fire_after / 10))
    published, published_at = -1, 0.0
    host = socket.gethostname()
    beat = heartbeat_seconds(fire_after)
    first = True  # publish at once: every rank's host is in the store from the start of fit
    while first or not stop.wait(poll):
        first = False
        where, steps, since, version = progress.read()
        if store.available and (version != published or time.monotonic() - published_at >= beat):
            try:
                store.put(f"rank{rank}", json.dumps({"where": where, "steps": steps, "time": time.time(),
                                                     "changed": time.time() - (time.monotonic() - since),
                                                     "host": host}))
                published = version
            except Exception:  # noqa: BLE001 - the store is a help for the message, never a reason to fail
                pass
            published_at = time.monotonic()
        stuck = time.monotonic() - since
        if stuck < fire_after:
            continue
        lines = [f"keras_boost: stall: rank {rank} of {size} on {host} has been {where} for {stuck:.0f} s "
                 f"(stall_timeout={timeout:g} s); ending the job."]
        lines += _others(store, rank, size, silent_after=3 * beat)
        print("\n".join(lines), file=sys.stderr, flush=True)
        os._exit(STALL_EXIT_CODE)


def _others(store, rank, size, silent_after=30.0):
    """Where every rank is, from the key-value store, and which ones are behind.

    Every worker republishes its position every `heartbeat_seconds`; a rank not heard of for
    `silent_after` seconds lost its host's link, or its process or host died: it is named,
    with its host, as the one to look at."""
    if not store.available:
        # Under MPI Horovod's own stall warning (rank 0) names the missing ranks only where its
        # coordinator is not blocked itself: with a stopped worker or a host cut off it was
        # seen to print nothing, so the message must not send users looking for it.
        return ["keras_boost: stall: the other ranks' positions are not known under this launcher. Every rank "
                "still running prints a line like the one above within seconds: a rank without one is the one "
                "that stopped, or whose host lost its link. (Horovod's stall warning on rank 0, where it can "
                "print one, names the missing ranks and tensors.)"]
    now, table, why = time.time(), {}, {}
    for other in range(size):
        try:
            table[other] = json.loads(store.get(f"rank{other}"))
        except Exception as error:  # noqa: BLE001
            table[other], why[other] = None, error
    lines = []
    for other, entry in table.items():
        if entry is None:
            lines.append(f"keras_boost: stall:   rank {other}: no position published (not started, or dead: "
                         f"{why[other]})")
        else:
            on = f" on {entry['host']}" if entry.get("host") else ""
            lines.append(f"keras_boost: stall:   rank {other}{on}: {entry['where']} (step {entry['steps']} of this "
                         f"fit, last change {now - entry.get('changed', entry['time']):.0f} s ago)")
    silent = [r for r, e in table.items() if e is not None and r != rank and now - e["time"] > silent_after]
    if silent:
        named = ", ".join(f"rank {r} on {table[r].get('host', '?')}" for r in silent)
        lines.append(f"keras_boost: stall: nothing heard from {named} for over {silent_after:.0f} s: that host lost "
                     "its network link, or the process or the host died. Check that host; the other ranks wait "
                     "for it.")
        return lines
    known = {r: e for r, e in table.items() if e is not None}
    behind = [r for r in range(size) if table[r] is None]
    if known and not behind:
        fewest = min(e["steps"] for e in known.values())
        behind = [r for r, e in known.items() if e["steps"] == fewest]
        outside = [r for r in behind if not known[r]["where"].startswith("in train step")]
        behind = outside or behind
    if behind and len(behind) < size:
        lines.append(f"keras_boost: stall: rank(s) {behind} stopped calling collectives; the others wait for them.")
    else:
        lines.append("keras_boost: stall: every rank is at the same step: one of them is stuck inside it (input "
                     "pipeline or a collective); see the positions above.")
    return lines


# Every line that names a lost rank starts so; `keras-boost`'s launcher repeats them at its end.
LOST_MARK = "keras_boost: lost: "


def abandoned_lines(rank, size, waited=None):
    """What a worker says when a collective of its fit was abandoned (Horovod shut down, Gloo timed out).

    Under Gloo every worker's watchdog republishes its position in the launcher's key-value
    store every few seconds (under MPI in the one rank 0 serves), so the ranks not heard of for a
    while are named with their hosts and how long ago they were last heard of; a worker that
    cannot reach the store itself is the one whose host lost its link (or the store's host is).
    Without a store the lines say so.
    """
    host = socket.gethostname()
    store = ProgressStore()
    waited_text = f" after waiting {waited:.0f} s" if waited is not None else ""
    head = f"{LOST_MARK}rank {rank} of {size} on {host}: a collective of fit was abandoned{waited_text}"
    relaunch = ("Check that host (`keras-boost info --hosts ...`), then relaunch the same command: a "
                "BackupAndRestore callback resumes from its last backup, `keras-boost train --checkpoint-dir` "
                "from its last checkpoint.")
    if not store.available:
        return [f"{head}: another worker died, raised (its error is above) or lost its host's link. Under this "
                "launcher the workers' positions are not known: a rank that printed nothing like this line is the "
                "one that stopped. " + relaunch]
    beat = heartbeat_seconds(distributed.stall_timeout() or 60.0)
    now, table = time.time(), {}
    try:
        table[rank] = json.loads(store.get(f"rank{rank}"))
    except Exception:  # noqa: BLE001 - this worker cannot reach the launcher's store: its own host is cut off
        return [f"{head}: this worker cannot reach {store.owner} at {store.addr}: {host} lost its network link "
                f"(or the host of {store.owner} died). " + relaunch]
    for other in range(size):
        if other != rank:
            try:
                table[other] = json.loads(store.get(f"rank{other}"))
            except Exception:  # noqa: BLE001
                table[other] = None
    silent = [r for r, entry in table.items()
              if r != rank and (entry is None or now - entry["time"] > 2 * beat + ProgressStore.TIMEOUT)]
    if not silent:
        return [f"{head}: every other rank was heard from in the last {2 * beat:.0f} s, so none lost its link; "
                "another worker raised (its error is above) or ended its script. " + relaunch]
    named = ", ".join(f"rank {r} on {table[r]['host']} (last heard {now - table[r]['time']:.0f} s ago)"
                      if table[r] else f"rank {r} (never heard from)" for r in silent)
    return [f"{head}: nothing heard from {named}: that host lost its network link, or the process or the host "
            "died. " + relaunch]
