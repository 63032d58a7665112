"""Elastic BoostModel training under `horovodrun --min-np 1 --max-np 2 --host-discovery-script`.

The first rank-1 process kills itself (SIGKILL, no clean-up) at its KILL_AT-th batch; the
marker file makes sure a later rank-1 process (the one that joins when Horovod lets the
blacklisted host back in) does not. Rank 0 then trains alone for ALONE batches, and then
waits at the start of a batch, committing and polling for host updates, until a worker
joins (at most WAIT_S seconds), so that the join happens before the epochs run out on
any machine.

Every committed batch is logged in the state (epoch, samples of all workers), so the
log is rolled back with the weights. Every rank alive at the end reports its weight hash,
the epochs done, the per-epoch history, the batch log, how many resets it went through,
whether it joined late, and the largest difference to a plain single-process Keras model
that replays exactly the logged batches (the same rows, in the same order).

Environment: KB_ELASTIC_MARKER (path of the marker file, required), KB_ELASTIC_EPOCHS
(default 5), KB_ELASTIC_KILL_AT (rank 1's batch to die at, default 22; 0: never),
KB_ELASTIC_ALONE (batches rank 0 trains alone before waiting, default 8),
KB_ELASTIC_WAIT_S (default 90; 0: do not wait for a joiner), KB_ELASTIC_KILL_RANK (the rank
that dies, default 1), KB_ELASTIC_ADASUM (1: compile
with AdaSum(device_number=1)), KB_ELASTIC_PLAN (hosts changing across a cluster, JSON:
{"hosts": path of the discovery file, "remove_at": rank 0's batch at which it rewrites the
file to "after_remove" (a host leaves), "after_wait": the file's lines when rank 0 starts
waiting for a joiner (a host is added)}).
"""

import hashlib
import json
import os
import socket
import signal
import time

from common import report

import keras
import numpy as np

import keras_boost
from keras_boost import BoostModel, distributed, elastic
from tests.helpers import classification_data, compile_sgd, mlp

MARKER = os.environ["KB_ELASTIC_MARKER"]
EPOCHS = int(os.environ.get("KB_ELASTIC_EPOCHS", "5"))
KILL_AT = int(os.environ.get("KB_ELASTIC_KILL_AT", "22"))
WAIT_S = float(os.environ.get("KB_ELASTIC_WAIT_S", "90"))
ALONE = int(os.environ.get("KB_ELASTIC_ALONE", "8"))
BATCH, EPOCHS_SEED = 16, 0
ADASUM = os.environ.get("KB_ELASTIC_ADASUM") == "1"
KILL_RANK = int(os.environ.get("KB_ELASTIC_KILL_RANK", "1"))
PLAN = json.loads(os.environ.get("KB_ELASTIC_PLAN", "null"))


def write_hosts(lines):
    """Rewrites the host discovery file (atomically: the discovery script never reads half)."""
    with open(PLAN["hosts"] + ".tmp", "w") as handle:
        handle.write(lines)
    os.replace(PLAN["hosts"] + ".tmp", PLAN["hosts"])
    print(f"elastic_train: rank 0 sets the hosts to {lines.split()}", flush=True)


class ChangeHosts(keras.callbacks.Callback):
    """At batch `remove_at` rank 0 takes a host out of the discovery file (a planned removal);
    then every worker polls for the update together (`check_host_updates` is a collective),
    a fixed number of times, so that the removal lands mid-run on all of them at once."""

    def __init__(self, state, joined_late):
        super().__init__()
        self.state = state
        self.batches = 0
        self.done = joined_late  # a worker that joins later never removes anything

    def on_train_batch_begin(self, batch, logs=None):
        self.batches += 1
        if not PLAN or self.done or self.batches != PLAN["remove_at"]:
            return
        self.done = True
        if distributed.rank() == 0:
            with open(MARKER, "w") as handle:
                handle.write("removed")
            write_hosts(PLAN["after_remove"])
        for _ in range(int(WAIT_S * 2)):
            time.sleep(0.5)
            self.state.check_host_updates()  # raises HostsUpdatedInterrupt on every worker once horovodrun saw it


class DieOnce(keras.callbacks.Callback):
    """The first rank-1 process dies at its KILL_AT-th batch, as a crashed machine would."""

    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.batches += 1
        if KILL_AT and self.batches == KILL_AT and distributed.rank() == KILL_RANK and not os.path.exists(MARKER):
            with open(MARKER, "w") as handle:
                handle.write(str(os.getpid()))
            print(f"elastic_train: rank {KILL_RANK} (pid {os.getpid()}) kills itself at its batch {KILL_AT}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class WaitForJoiner(keras.callbacks.Callback):
    """Alone after the failure, rank 0 trains ALONE batches, then commits and polls until a worker joins."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self.alone = 0

    def on_train_batch_begin(self, batch, logs=None):
        if not WAIT_S or distributed.size() > 1 or not os.path.exists(MARKER) or self.state.waited:
            return
        self.alone += 1
        if self.alone <= ALONE:
            return
        self.state.waited = True  # committed below: wait once per job
        self.state.commit()
        if PLAN:
            write_hosts(PLAN["after_wait"])
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.5)
            self.state.check_host_updates()  # raises HostsUpdatedInterrupt once the joiner is up
        print("elastic_train: no worker joined within the wait", flush=True)


class LogBatches(keras.callbacks.Callback):
    """Appends (epoch, samples of all workers) of every batch to the state (committed with it)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        # a new list: the last commit keeps the old one
        self.state.log = self.state.log + [[self.epoch, BATCH * distributed.size()]]


def replay(x, y, log):
    """A plain Keras model trained on exactly the logged global batches, in order."""
    reference = compile_sgd(mlp(keras.Model), lr=0.05)
    position = {}
    for epoch, samples in log:
        order = elastic.epoch_shard(len(x), epoch, 0, 1, 0, 1, shuffle=True, seed=EPOCHS_SEED)
        start = position.get(epoch, 0)
        rows = order[start:start + samples]
        position[epoch] = start + samples
        reference.train_on_batch(x[rows], y[rows])
    return reference


def main():
    distributed.init()
    joined_late = os.path.exists(MARKER)
    x, y = classification_data(n=512)
    stages = {"adasum": keras_boost.AdaSum(device_number=1)} if ADASUM else {}
    model = compile_sgd(mlp(BoostModel), lr=0.05, **stages)
    state = elastic.BoostModelState(model, log=[], waited=False)
    start = time.monotonic()
    history = elastic.fit_elastic(model, x, y, state, batch_size=BATCH, epochs=EPOCHS, batches_per_commit=4,
                                  seed=EPOCHS_SEED, callbacks=[DieOnce(), ChangeHosts(state, joined_late), WaitForJoiner(state),
                                                                    LogBatches(state)],
                                  verbose=0)
    seconds = round(time.monotonic() - start, 1)
    weights = [np.asarray(w) for w in model.get_weights()]
    optimizer = [np.asarray(v) for v in model.optimizer.variables]
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights + optimizer)).hexdigest()
    weights_digest = hashlib.sha256(b"".join(w.tobytes() for w in weights)).hexdigest()
    reference = replay(x, y, state.log)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(reference.get_weights(), weights))
    report(distributed.rank(), size=distributed.size(), digest=digest, weights_digest=weights_digest, epochs=state.epoch, history=history,
           log=state.log, resets=state.resets, joined_late=joined_late, reference_diff=diff,
           iterations=int(model.optimizer.iterations.numpy()), seconds=seconds,
           adasum_groups=model.boost_step.stage("adasum").groups if ADASUM else None, hostname=socket.gethostname())


if __name__ == "__main__":
    main()
