"""Many hosts (issue 25): per-worker images/s and scaling efficiency on 1, 2 and 4 hosts, in the
form of Horovod's synthetic benchmark (horovod/examples/tensorflow2/tensorflow2_synthetic_benchmark.py).

    .venv/bin/python scripts/bench_hosts.py --rounds 3 --raw hosts.jsonl --table hosts.md

What runs: a cluster of real hosts on this machine (tests/cluster.py: network namespaces on a
bridge, each with its own hostname, address and sshd; the file system is shared), named
<prefix>1..<prefix>N with the first free session prefix (kbt1.., kbu1.., ...; called H1..HN
here). For every link rate (`--rates`: `none` = unlimited veth, or a tc rate such as
`1gbit`, `100mbit`: `tc ... tbf` on both sides of every host's link, burst 256kbit) a fresh
`Cluster.up(max(--hosts), rate=...)`; then every model x host count x configuration is one
launch of its own, `horovodrun -np N -H H1:1,...,HN:1 --gloo` (or `--controller mpi`)
started inside H1 with `--network-interfaces eth0` (what a cluster user passes; it skips
horovodrun's interface discovery, not part of any step). The order within a round is
rates, then models, then host counts, then configurations, taking turns, their order rotated
by one from each point to the next (so that none is always first); `--rounds` repeats it. A run on 1 host has no network: by default it is measured once
per round, under the first rate, and serves as the 1-host column (the efficiency baseline)
of every link (`--one-host-every-link` measures it under each rate). After each cluster
start, one TCP stream H1 -> H2 measures what the link really carries (`--no-probe` skips it).

Configurations (`--configs`), all on the same model, synthetic data, per-worker batch
(`--batch-size`, default 32) and optimizer (`keras.optimizers.SGD(0.01, momentum=0.9)`):
    keras_boost-O0     keras_boost.BoostModel, compile(...) plainly (no NaN guard, the default), model.fit on
                       tf.data.Dataset.from_tensors(one batch).repeat()
    keras_boost-fp16   the same with compile(..., compression="float16"); "unavailable" when compile
                       rejects the option
    keras_boost-acc4   compile(..., gradient_accumulation=4): one allreduce per 4 micro-batches; the
                       rate counts every micro-batch's samples; warm-up and timed steps are rounded up
                       to multiples of 4 so that the timed window holds whole accumulation windows
    keras_boost-O0-each compile(..., gradient_split_groups="each"): every gradient to Horovod as soon as
                       the backward pass produces it (the default: one grouped allreduce per update)
    keras_boost-adasum compile(..., adasum=True) (keras_boost.AdaSum; one worker per host, so every
                       worker is its own group)
    hvd-loop           what a Horovod user writes instead (Horovod's TF2 examples): `import
                       horovod.tensorflow as hvd; hvd.init()`, a plain keras.Model, a @tf.function step
                       with hvd.DistributedGradientTape(tape) and opt.apply_gradients, the variables
                       (model and optimizer) broadcast from rank 0 after the first step; the same
                       tf.data batches. Horovod 0.28.1's tape calls `source.ref()`, which Keras 3
                       variables lack (AttributeError: 'Variable' object has no attribute 'ref'), so
                       the tape and the broadcast get the tf.Variables behind them (`v.value`), the
                       workaround a Horovod user on Keras 3 needs. No keras_boost imported at all
                       (the demo network's file is executed with keras.Model in place of
                       BoostModel; the worker records that `keras_boost` is absent from sys.modules)
    mwms               tf.distribute.MultiWorkerMirroredStrategy with Keras 3 fit across the same
                       hosts: horovodrun only starts the processes; each builds TF_CONFIG
                       (`{"cluster": {"worker": ["H1:PORT", ...]}, "task": {"index": HOROVOD_RANK}}`,
                       `--mwms-port`) and never initialises Horovod; the dataset is the global batch
                       (batch x workers, auto-sharding off) that the strategy splits into per-worker
                       batches. Keras 3's multi-worker path is reported broken upstream
                       (https://github.com/keras-team/keras/issues/20585): a failure is recorded with
                       its first error line and that issue instead of a number. With Keras 3.15.1
                       and TF 2.18.1 it fails on 2+ workers at the start of fit, before any step:
                       the TF trainer's `_maybe_symbolic_build` calls `strategy.reduce("MEAN", <the
                       first PerReplica batch>)`, and the collective reduce cannot convert it
                       ("ValueError: Attempt to convert a value (PerReplica:{...}) with an
                       unsupported type (...PerReplica) to a Tensor."); on 1 worker there is no
                       PerReplica value and it trains.

Models (`--models`):
    demo           keras_boost.app.demo_net.demo_resnet: 77,754 parameters (311 KB of float32
                   gradients per step), input 28x28x1 (Fashion-MNIST's shape), random data
    resnet50-grad  ResNet-50's gradient size with cheap compute, so that the network, not the two
                   CPU cores, is measured: 32x32x3 -> Flatten -> Dense(8298, relu) -> Dense(10):
                   3072*8298 + 8298 + 8298*10 + 10 = 25,582,744 float32 parameters in 4 tensors
                   (102.33 MB of gradients per step), against Keras ResNet50's 25,583,592
                   trainable parameters (25,636,712 in all, 1000 classes)
    resnet50       keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)

Timing, per worker: `--warmup` steps (default 3) untimed, then `--steps` timed steps (default
10); a run whose allreduce would take over `--slow-seconds` (default 2 s) per step at the
link's nominal rate (gradient bytes x 2(N-1)/N x 8 / rate: ResNet-50's gradients on 100
Mbit/s) takes `--warmup-slow` (1) and `--steps-slow` (3) instead. The Keras configurations
run `model.fit(dataset, steps_per_epoch=warmup + steps, epochs=1)` with a callback that
records every batch's begin and end (scripts/bench_common.StepTimer, plus the end times); the
timed window runs from the end of the last warm-up batch to the end of the last batch, so it
holds everything between batches too, as Horovod's `timeit` over its loop does. hvd-loop times
the same window around its loop; it warms up at least 2 steps, since its step function is
traced twice (first_batch=True, then False, as in Horovod's example). A worker's rate is
batch x timed steps / window; the run's per-worker rate is batch x timed steps / the slowest
worker's window (the workers are in lock-step; each worker's own rate is in the raw file,
with its median step time).
Scaling efficiency at N hosts = per-worker rate at N hosts / per-worker rate at 1 host.

CPU sharing: the machine has few cores for up to 4 workers. Every worker, first thing
(before TensorFlow or Horovod is imported), pins itself with
`os.sched_setaffinity(0, {cpus[global_rank % len(cpus)]})` (cpus = the process's allowed CPUs,
sorted: ranks 0 and 2 share the first core and ranks 1 and 3 the second on 2 cores), so every
thread it later starts (TensorFlow's pools, Horovod's background and Gloo threads) stays on
that core; then `tf.config.threading.set_intra_op_parallelism_threads(T)` and
`set_inter_op_parallelism_threads(T)` with T = `--threads` (default 1). `os.getloadavg()` is
printed (and recorded) before every run.

Output: one JSON line per run to `--raw` (status "ok", "failed", "timeout" or
"unavailable"; per-rank windows, step times, affinity; the error's first line and the log's
tail on failure), and a Markdown table to stdout and `--table`, with the command line that
produced it: rows = model x link x configuration, columns = per-worker img/s at each host
count (median over the rounds, range in brackets), efficiency at each N > 1, and each
configuration's rate over hvd-loop's at the same point.

Robustness: every launch has a timeout (`--run-timeout`, default 300 s) after which its
process group and every process on the cluster's hosts (`Cluster.kill_jobs()`) are killed;
the run is recorded as "timeout" and the benchmark goes on. The cluster is torn down and the
lock removed at the end whatever happens (Ctrl-C and SIGTERM included).

Sharing the machine: `Cluster.up` takes a name prefix no other session holds, and
`cluster.down()` frees it. On top of that, so that measurements do not overlap other
engineers' cluster work, this waits before making a cluster until no `/tmp/kb_cluster_*.lock`
other than its own (`--lock`, default /tmp/kb_cluster_c.lock; `--no-lock` skips the
protocol) exists (polling every 20 s), creates its lock, and removes it after
`cluster.down()`. It gives the cluster back between runs once it has held it for
`--max-hold` seconds (default 240; 0: keep it until the rate's runs are done), then waits
for the lock and makes a fresh cluster of the same rate.
"""

import argparse
import glob
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
MWMS_ISSUE = "https://github.com/keras-team/keras/issues/20585"

CONFIGS = ("keras_boost-O0", "keras_boost-fp16", "keras_boost-acc4", "keras_boost-adasum", "hvd-loop", "mwms", "keras_boost-O0-each",
           "keras_boost-O0-each-noguard", "keras_boost-O0-noguard", "keras_boost-O0-guard", "hvd-fit",
           "hvd-fit-grouped", "keras_boost-O0-static")
KERAS_BOOST_OPTIONS = {
    "keras_boost-O0": {},
    "keras_boost-fp16": {"compression": "float16"},
    "keras_boost-acc4": {"gradient_accumulation": 4},
    "keras_boost-adasum": {"adasum": True},
    # every gradient to Horovod as soon as the backward pass produces it (as Horovod's tape)
    "keras_boost-O0-each": {"gradient_split_groups": "each"},
    # the same without the NaN guard (no finiteness check, no cond around the update), as the loop
    "keras_boost-O0-each-noguard": {"gradient_split_groups": "each", "nan_guard": False},
    "keras_boost-O0-noguard": {"nan_guard": False},
    # with the NaN guard (opt-in since December 5, 2026): the finite check before every update
    "keras_boost-O0-guard": {"nan_guard": True},
    # O0 with Horovod's dynamic process sets off (HOROVOD_DYNAMIC_PROCESS_SETS=0 before init)
    "keras_boost-O0-static": {},
}
MODELS = ("demo", "resnet50-grad", "resnet50")
# float32 gradient bytes per step (trainable parameters x 4), to decide which runs are slow.
GRADIENT_BYTES = {"demo": 77_754 * 4, "resnet50-grad": 25_582_744 * 4, "resnet50": 23_555_082 * 4}
RESNET50_GRAD_HIDDEN = 8298
LOCK_POLL_SECONDS = 20


# =============================================================================== worker side
def _rank_from_env():
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def pin_this_process(rank, threads):
    """The CPU sharing of every worker (see the module docstring); returns what was set."""
    cpus = sorted(os.sched_getaffinity(0))
    core = cpus[rank % len(cpus)]
    os.sched_setaffinity(0, {core})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return {"core": core, "allowed_cpus": cpus, "intra_op_threads": threads, "inter_op_threads": threads}


def _demo_resnet(plain):
    """demo_net.demo_resnet; `plain`: without importing keras_boost (its file run with keras.Model as BoostModel)."""
    if not plain:
        from keras_boost.app.demo_net import demo_resnet

        return demo_resnet
    path = ROOT / "keras_boost" / "app" / "demo_net.py"
    source = path.read_text()
    line = "from keras_boost.model import BoostModel"
    if line not in source:
        raise RuntimeError(f"{path} no longer has the line {line!r}: update bench_hosts._demo_resnet")
    namespace = {"__name__": "demo_net_without_keras_boost"}
    exec(compile(source.replace(line, "import keras as _keras\nBoostModel = _keras.Model"), str(path), "exec"),
         namespace)
    return namespace["demo_resnet"]


def build_model(name, model_class, plain):
    """(model, input shape, from_logits) of `name`, with `model_class` (keras.Model or BoostModel)."""
    import keras

    keras.utils.set_random_seed(0)
    if name == "demo":
        return _demo_resnet(plain)(model_class=model_class), (28, 28, 1), True
    if name == "resnet50-grad":
        inputs = keras.Input((32, 32, 3))
        x = keras.layers.Flatten()(inputs)
        x = keras.layers.Dense(RESNET50_GRAD_HIDDEN, activation="relu")(x)
        outputs = keras.layers.Dense(10)(x)
        return model_class(inputs, outputs, name="resnet50_grad"), (32, 32, 3), True
    if name == "resnet50":
        base = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
        return model_class(base.inputs, base.outputs, name="resnet50"), (32, 32, 3), False
    raise ValueError(f"unknown model {name!r}")


def synthetic_batch(shape, batch):
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.random((batch, *shape), dtype=np.float32), rng.integers(0, 10, batch).astype(np.int64)


def batch_dataset(x, y):
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


def _timer():
    from bench_common import StepTimer  # scripts/ is on sys.path (this file's folder)

    class WindowTimer(StepTimer):
        """StepTimer (each batch's begin to end) plus the end time of every batch."""

        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            self.ends.append(time.perf_counter())

    return WindowTimer()


def _window(ends, warmup, steps):
    """Seconds from the end of the last warm-up step to the end of the last timed step."""
    if len(ends) < warmup + steps:
        raise RuntimeError(f"only {len(ends)} steps ran of {warmup} + {steps}")
    return ends[warmup + steps - 1] - ends[warmup - 1]


def _keras_loss(from_logits):
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)


def _optimizer():
    import keras

    return keras.optimizers.SGD(0.01, momentum=0.9)


def worker_keras_boost(args):
    from keras_boost import distributed

    if args.worker == "keras_boost-O0-static":
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "0"
    distributed.init(process_sets=True if args.worker == "keras_boost-adasum" else None)  # AdaSum's groups
    import keras_boost

    model, shape, from_logits = build_model(args.model, keras_boost.BoostModel, plain=False)
    options = KERAS_BOOST_OPTIONS[args.worker]
    try:
        model.compile(optimizer=_optimizer(), loss=_keras_loss(from_logits), **options)
    except (TypeError, ValueError) as error:
        if args.worker == "keras_boost-fp16":
            return {"status": "unavailable", "error": _first_line(error)}
        raise
    x, y = synthetic_batch(shape, args.batch_size)
    timer = _timer()
    model.fit(batch_dataset(x, y), steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0, callbacks=[timer])
    return {"status": "ok", "rank": distributed.rank(), "size": distributed.size(),
            "window": _window(timer.ends, args.warmup, args.steps), "step_times": timer.times,
            "parameters": int(sum(int(v.numpy().size) for v in model.trainable_variables))}


def worker_hvd_loop(args):
    """Horovod's own TF2 pattern (tensorflow2_synthetic_benchmark.py), on a Keras 3 model."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    model, shape, from_logits = build_model(args.model, keras.Model, plain=True)
    opt = _optimizer()
    opt.build(model.trainable_variables)  # the slots exist before the first trace
    loss_fn = _keras_loss(from_logits)

    # Horovod 0.28.1's DistributedGradientTape keys the gradients by `source.ref()`, which Keras 3
    # variables lack ("AttributeError: 'Variable' object has no attribute 'ref'"): a Horovod user
    # on Keras 3 gives the tape (and the broadcast) the tf.Variables behind them (`v.value`).
    trainable = [v.value for v in model.trainable_variables]
    state = [v.value for v in model.variables] + [v.value for v in opt.variables]

    @tf.function
    def benchmark_step(x, y, first_batch):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        tape = hvd.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, trainable)
        opt.apply_gradients(zip(gradients, model.trainable_variables))
        # Horovod: broadcast the initial state from rank 0 after the first step (optimizer included).
        if first_batch:
            hvd.broadcast_variables(state, root_rank=0)
        return loss

    x, y = synthetic_batch(shape, args.batch_size)
    iterator = iter(batch_dataset(x, y))
    ends, times = [], []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        bx, by = next(iterator)
        loss = benchmark_step(bx, by, step == 0)
        loss.numpy()  # the step is done (tf.function calls are synchronous on the CPU anyway)
        ends.append(time.perf_counter())
        times.append(ends[-1] - start)
    return {"status": "ok", "rank": hvd.rank(), "size": hvd.size(), "window": _window(ends, args.warmup, args.steps),
            "step_times": times, "parameters": int(sum(int(v.numpy().size) for v in model.trainable_variables)),
            "keras_boost_imported": any(m == "keras_boost" or m.startswith("keras_boost.") for m in sys.modules)}


def worker_hvd_fit(args, grouped=False):
    """Horovod's tape in a Keras 3 `train_step`, trained by `fit`: hvd-loop's step under Keras' loop (no keras_boost).

    `grouped`: the gradients in one `hvd.grouped_allreduce` after the backward pass instead
    (keras_boost's default pattern), with Horovod's own calls.
    """
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    base, shape, from_logits = build_model(args.model, keras.Model, plain=True)

    class HorovodModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            if grouped:
                grads = hvd.grouped_allreduce(tape.gradient(loss, [v.value for v in self.trainable_variables]),
                                              op=hvd.Average)
            else:
                grads = hvd.DistributedGradientTape(tape).gradient(loss, [v.value for v in self.trainable_variables])
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"loss": loss}

    model = HorovodModel(base.inputs, base.outputs)
    model.compile(optimizer=_optimizer(), loss=_keras_loss(from_logits))
    model.optimizer.build(model.trainable_variables)

    class Broadcast(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            hvd.broadcast_variables([v.value for v in model.variables] + [v.value for v in model.optimizer.variables],
                                    root_rank=0)

    x, y = synthetic_batch(shape, args.batch_size)
    timer = _timer()
    model.fit(batch_dataset(x, y), steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0,
              callbacks=[Broadcast(), timer])
    return {"status": "ok", "rank": hvd.rank(), "size": hvd.size(), "window": _window(timer.ends, args.warmup, args.steps),
            "step_times": timer.times, "parameters": int(sum(int(v.numpy().size) for v in model.trainable_variables)),
            "keras_boost_imported": any(m == "keras_boost" or m.startswith("keras_boost.") for m in sys.modules)}


def worker_mwms(args):
    """tf.distribute.MultiWorkerMirroredStrategy with Keras 3, TF_CONFIG from the host list and the launcher's rank."""
    rank = _rank_from_env()
    hosts = args.worker_hosts.split(",")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"{h}:{args.mwms_port}" for h in hosts]},
                                          "task": {"type": "worker", "index": rank}})
    import keras
    import tensorflow as tf

    keras.config.disable_traceback_filtering()  # a failure's traceback names Keras' own frames
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model, shape, from_logits = build_model(args.model, keras.Model, plain=True)
        model.compile(optimizer=_optimizer(), loss=_keras_loss(from_logits))
    workers = strategy.num_replicas_in_sync
    x, y = synthetic_batch(shape, args.batch_size * workers)  # the global batch; the strategy splits it
    timer = _timer()
    model.fit(batch_dataset(x, y), steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0, callbacks=[timer])
    return {"status": "ok", "rank": rank, "size": workers, "window": _window(timer.ends, args.warmup, args.steps),
            "step_times": timer.times, "parameters": int(sum(int(v.numpy().size) for v in model.trainable_variables)),
            "keras_boost_imported": any(m == "keras_boost" or m.startswith("keras_boost.") for m in sys.modules)}


def _first_line(error):
    """`Type: message`'s first line, and its last line when the message spans several (a tensor's
    value in between); for TensorFlow's "in user code:" errors, the message's last line."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if lines and lines[0] == "in user code:":
        return lines[-1][:300]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    if len(lines) > 1:
        text += f" ... {lines[-1]}"
    return text[:400]


def _write_result(directory, rank, values):
    path = os.path.join(directory, f"rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump({"rank": rank, **values}, handle)
    os.replace(path + ".tmp", path)


def worker(args):
    """One configuration on this worker; writes rank<R>.json into --result-dir."""
    rank = _rank_from_env()
    pinned = pin_this_process(rank, args.threads)  # before anything starts threads
    sys.path.insert(0, str(THIS.parent))
    sys.path.insert(0, str(ROOT))
    started = time.perf_counter()
    try:
        if args.worker == "hvd-loop":
            result = worker_hvd_loop(args)
        elif args.worker in ("hvd-fit", "hvd-fit-grouped"):
            result = worker_hvd_fit(args, grouped=args.worker == "hvd-fit-grouped")
        elif args.worker == "mwms":
            result = worker_mwms(args)
        else:
            result = worker_keras_boost(args)
    except BaseException as error:  # noqa: BLE001 - recorded, then this worker ends at once
        _write_result(args.result_dir, rank, {"status": "failed", "error": _first_line(error),
                                              "traceback": traceback.format_exc()[-4000:], "pinned": pinned,
                                              "host": socket.gethostname()})
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # peers blocked in a collective must not keep this process alive
    result.update(pinned=pinned, host=socket.gethostname(), worker_seconds=time.perf_counter() - started)
    _write_result(args.result_dir, rank, result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing left to do; Horovod's and the strategy's shutdowns are not part of any measurement


# ========================================================================= orchestrator side
def parse_rate(text):
    """A tc rate in bits per second (None for an unlimited link)."""
    if text is None:
        return None
    units = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1, "tbps": 8e12, "gbps": 8e9,
             "mbps": 8e6, "kbps": 8e3, "bps": 8}
    lowered = text.lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return float(lowered[: -len(unit)]) * factor
    return float(lowered)


def rate_arg(text):
    if text.lower() in ("none", "unlimited", "0"):
        return None
    try:
        parse_rate(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a tc rate: {text!r} (none, 1gbit, 100mbit, ...)") from None
    return text


def link_name(rate):
    return "unlimited" if rate is None else rate


def steps_of(args, model, rate, hosts, config):
    """(warmup, timed steps, slow?) of one run."""
    slow = False
    if rate is not None and hosts > 1:
        seconds = GRADIENT_BYTES[model] * 2 * (hosts - 1) / hosts * 8 / parse_rate(rate)
        slow = seconds > args.slow_seconds
    warmup, steps = (args.warmup_slow, args.steps_slow) if slow else (args.warmup, args.steps)
    if config == "keras_boost-acc4":  # whole accumulation windows in and before the timed window
        warmup, steps = -(-warmup // 4) * 4, -(-steps // 4) * 4
    if config == "hvd-loop":  # its step is traced twice: first_batch=True, then False (Horovod's example)
        warmup = max(warmup, 2)
    return warmup, steps, slow


class Lock:
    """The cluster lock protocol: only one holder of /tmp/kb_cluster_*.lock at a time."""

    def __init__(self, path, enabled=True):
        self.path = path
        self.enabled = enabled
        self.held = False

    def others(self):
        mine = os.path.abspath(self.path)
        return sorted(p for p in glob.glob("/tmp/kb_cluster_*.lock") if os.path.abspath(p) != mine)

    def acquire(self):
        if not self.enabled or self.held:
            return
        announced = None
        while True:
            others = self.others()
            if not others:
                with open(self.path, "w") as handle:
                    handle.write(f"{os.getpid()} {' '.join(sys.argv)}\n")
                time.sleep(0.5)
                if not self.others():  # nobody took theirs at the same moment
                    self.held = True
                    return
                os.remove(self.path)
                time.sleep(LOCK_POLL_SECONDS / 2 + (os.getpid() % 10))
                continue
            if others != announced:
                print(f"waiting for the cluster: {', '.join(others)} exist(s); polling every {LOCK_POLL_SECONDS} s",
                      flush=True)
                announced = others
            time.sleep(LOCK_POLL_SECONDS)

    def release(self):
        if self.held:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            self.held = False


class Holder:
    """The cluster of one rate, made under the lock, given back after --max-hold seconds."""

    def __init__(self, args, lock):
        self.args = args
        self.lock = lock
        self.cluster = None
        self.rate = None
        self.since = None

    def get(self, rate, next_run_estimate=0.0):
        from tests.cluster import Cluster

        if self.cluster is not None and self.rate == rate and self.args.max_hold > 0:
            if time.monotonic() - self.since + next_run_estimate > self.args.max_hold:
                print(f"giving the cluster back after {time.monotonic() - self.since:.0f} s (--max-hold "
                      f"{self.args.max_hold:g})", flush=True)
                self.give_back()
        if self.cluster is not None and self.rate != rate:
            self.give_back()
        if self.cluster is None:
            self.lock.acquire()
            started = time.monotonic()
            self.cluster = Cluster.up(max(self.args.hosts), rate=rate)  # the first free name prefix
            self.rate, self.since = rate, time.monotonic()
            print(f"cluster up: hosts {', '.join(self.cluster.hosts)}, link {link_name(rate)} "
                  f"({self.since - started:.1f} s)", flush=True)
            return True
        return False

    def give_back(self):
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            try:
                cluster.kill_jobs()
            finally:
                cluster.down()  # also frees its name prefix for other sessions
        self.lock.release()


def probe_link(cluster, rate):
    """TCP throughput host 1 -> host 2 (one stream), to see what the link really carries."""
    if cluster.n < 2:
        return None
    first, second = cluster.hosts[:2]
    size = 8 << 20 if rate is not None and parse_rate(rate) <= 200e6 else 64 << 20
    port = 29371
    server_code = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('0.0.0.0', {port})); s.listen(1); s.settimeout(30)\n"
        "c, _ = s.accept(); n = 0\n"
        "while True:\n"
        "    b = c.recv(1 << 20)\n"
        "    if not b: break\n"
        "    n += len(b)\n"
        "c.sendall(str(n).encode()); c.close()\n")
    client_code = (
        "import socket, time\n"
        f"size = {size}; chunk = b'x' * (1 << 20)\n"
        "for attempt in range(50):\n"
        "    try:\n"
        f"        c = socket.create_connection(('{second}', {port}), timeout=5); break\n"
        "    except OSError: time.sleep(0.1)\n"
        "c.settimeout(60); t = time.perf_counter(); sent = 0\n"
        "while sent < size:\n"
        "    c.sendall(chunk); sent += len(chunk)\n"
        "c.shutdown(socket.SHUT_WR); got = int(c.recv(64)); t = time.perf_counter() - t\n"
        "print(got, t)\n")
    server = cluster.popen(second, [sys.executable, "-c", server_code], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        done = cluster.run(first, [sys.executable, "-c", client_code], timeout=90)
        got, seconds = done.stdout.split()
        return {"bytes": int(got), "seconds": float(seconds), "mbit_s": int(got) * 8 / float(seconds) / 1e6}
    except (subprocess.TimeoutExpired, ValueError) as error:
        return {"error": _first_line(error)}
    finally:
        server.kill()
        server.wait()


def launch(args, cluster, model, hosts, config, warmup, steps, log_path):
    """One horovodrun launch inside the first host; returns (status, per-rank results, seconds, log tail)."""
    from tests.launch import horovod_build_env, horovodrun_command

    names = cluster.hosts[:hosts]
    result_dir = tempfile.mkdtemp(prefix="kb_bench_hosts_")
    worker_cmd = [sys.executable, str(THIS), "--worker", config, "--model", model, "--batch-size", str(args.batch_size),
                  "--warmup", str(warmup), "--steps", str(steps), "--threads", str(args.threads),
                  "--worker-hosts", ",".join(names), "--mwms-port", str(args.mwms_port), "--result-dir", result_dir]
    # On one host horovodrun looks for the interface of 127.0.0.1 (`lo`): no interface option there.
    nics = ["--network-interfaces", "eth0"] if hosts > 1 else []
    cmd = [*horovodrun_command(), "-np", str(hosts), "-H", ",".join(f"{h}:1" for h in names),
           f"--{args.controller}", "--start-timeout", "60", *nics, *worker_cmd]
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1",
                "CUDA_VISIBLE_DEVICES": "", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
                "OMPI_MCA_mpi_yield_when_idle": "1", **horovod_build_env()})
    started = time.monotonic()
    status = None
    with open(log_path, "w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        proc = cluster.popen(cluster.hosts[0], cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            cluster.kill_jobs()  # a worker that outlived its launcher
    seconds = time.monotonic() - started
    ranks = {}
    for name in os.listdir(result_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(result_dir, name)) as handle:
                data = json.load(handle)
            ranks[data["rank"]] = data
    tail = Path(log_path).read_text(errors="replace")[-3000:]
    if status is None:
        statuses = {r.get("status") for r in ranks.values()}
        if "failed" in statuses or proc.returncode != 0 or len(ranks) != hosts:
            status = "failed"
        elif statuses == {"unavailable"}:
            status = "unavailable"
        else:
            status = "ok"
    return status, ranks, seconds, tail, proc.returncode


def first_error(ranks, tail):
    for rank in sorted(ranks):
        if ranks[rank].get("error"):
            return ranks[rank]["error"]
    lines = [l.strip() for l in tail.splitlines() if l.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "no output"


def make_table(args, runs, command_line):
    """The Markdown table: rows model x link x configuration; medians over the rounds."""
    from keras_boost.app.turns import median_range  # the statistic every benchmark shares (ROOT is on sys.path)

    hosts_list = sorted(args.hosts)
    probes = [r for r in runs if r.get("kind") == "link_probe"]
    runs = [r for r in runs if r.get("kind") == "run"]
    lines = ["`" + command_line + "`", ""]
    loads = [r["load_before"][0] for r in runs if "load_before" in r]
    lines.append(
        f"Per-worker images/s (median over {args.rounds} round(s), range in brackets), {args.controller} controller, "
        f"batch {args.batch_size} per worker, {args.warmup} warm-up + {args.steps} timed steps "
        f"({args.warmup_slow} + {args.steps_slow} where an allreduce takes over {args.slow_seconds:g} s at the "
        f"nominal rate; acc4 rounds both up to multiples of 4, counting micro-batches), each worker pinned to one core "
        f"(rank % cores) with {args.threads} intra-op and inter-op thread(s); 1-minute load before the runs "
        f"{min(loads):.1f}-{max(loads):.1f}." if loads else "No runs.")
    one_host_shared = 1 in hosts_list and not args.one_host_every_link
    if one_host_shared:
        lines.append("The 1-host column (no network) was measured once per round and serves every link.")
    lines.append("")
    header = ["model", "link", "configuration"] + [f"img/s @{h}" for h in hosts_list]
    multi = [h for h in hosts_list if h > 1]
    if 1 in hosts_list:
        header += [f"efficiency @{h}" for h in multi]
    header += [f"vs hvd-loop @{h}" for h in hosts_list]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    notes = []

    def cell_runs(model, rate, hosts, config):
        if hosts == 1 and one_host_shared:
            return [r for r in runs if r["model"] == model and r["hosts"] == 1 and r["config"] == config]
        return [r for r in runs if r["model"] == model and r["rate"] == rate and r["hosts"] == hosts
                and r["config"] == config]

    def rates_of(model, rate, hosts, config):
        return [r["img_s_per_worker"] for r in cell_runs(model, rate, hosts, config) if r["status"] == "ok"]

    def status_cell(model, rate, hosts, config):
        found = cell_runs(model, rate, hosts, config)
        if not found:
            return "-"
        ok = [r["img_s_per_worker"] for r in found if r["status"] == "ok"]
        bad = [r for r in found if r["status"] != "ok"]
        text = median_range(ok, 1) if ok else ""
        if bad:
            kinds = sorted({r["status"] for r in bad})
            for r in bad:
                note = f"{r['status']}: {r.get('error', '')}" + (f" ({r['issue']})" if r.get("issue") else "")
                if note not in notes:
                    notes.append(note)
            marks = ",".join(str(notes.index(f"{r['status']}: {r.get('error', '')}" +
                                             (f" ({r['issue']})" if r.get("issue") else "")) + 1) for r in bad)
            text = (text + f" ({len(bad)}/{len(found)} {'/'.join(kinds)} [{marks}])").strip() if ok else \
                f"{'/'.join(kinds)} [{marks}]"
        return text

    for model in args.models:
        for rate in args.rates:
            for config in args.configs:
                row = [model, link_name(rate), config]
                medians = {}
                for h in hosts_list:
                    row.append(status_cell(model, rate, h, config))
                    values = rates_of(model, rate, h, config)
                    medians[h] = statistics.median(values) if values else None
                if 1 in hosts_list:
                    for h in multi:
                        row.append(f"{medians[h] / medians[1]:.3f}" if medians[h] and medians[1] else "-")
                for h in hosts_list:
                    ref = rates_of(model, rate, h, "hvd-loop")
                    if config == "hvd-loop":
                        row.append("1" if medians[h] else "-")
                    elif medians[h] and ref:
                        row.append(f"{medians[h] / statistics.median(ref):.3f}")
                    else:
                        row.append("-")
                lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines.append("")
        lines.extend(f"[{i + 1}] {note}" for i, note in enumerate(notes))
    if probes:
        lines.append("")
        by_rate = {}
        for p in probes:
            if p.get("mbit_s"):
                by_rate.setdefault(link_name(p["rate"]), []).append(p["mbit_s"])
        if by_rate:
            measured = "; ".join(f"{rate}: {statistics.median(v):.0f} Mbit/s" for rate, v in by_rate.items())
            lines.append(f"Measured TCP throughput host 1 -> host 2 (one stream, after each cluster start): "
                         f"{measured}.")
    return "\n".join(lines)


def plan(args):
    """The runs in order: (round, rate, model, hosts, config).

    The configurations of one point take turns, and their order rotates from one point to
    the next: each configuration runs first (right after a cluster start or a change of
    host count, when the machine is still settling) as often as every other. (With a fixed
    order, the configuration always run first measured 0.87x of the one run third on one
    host, where both ran the same code.)
    """
    order, turn = [], 0
    for round_index in range(args.rounds):
        for rate_index, rate in enumerate(args.rates):
            for model in args.models:
                for hosts in args.hosts:
                    if hosts == 1 and rate_index > 0 and not args.one_host_every_link:
                        continue
                    shift = turn % len(args.configs)
                    turn += 1
                    for config in args.configs[shift:] + args.configs[:shift]:
                        order.append((round_index, rate, model, hosts, config))
    return order


def orchestrate(args):
    from tests.cluster import cannot_make_reason

    reason = cannot_make_reason()
    if reason:
        sys.exit(f"cannot make a cluster here: {reason}")
    exe = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else sys.executable
    command_line = shlex.join([exe, os.path.relpath(THIS) if str(THIS).startswith(os.getcwd()) else str(THIS),
                               *sys.argv[1:]])
    print(command_line, flush=True)
    order = plan(args)
    print(f"{len(order)} runs: rates {[link_name(r) for r in args.rates]}, models {args.models}, hosts {args.hosts}, "
          f"configurations {args.configs}, {args.rounds} round(s)", flush=True)
    runs = []
    if args.raw:
        open(args.raw, "w").close()
    logs = tempfile.mkdtemp(prefix="kb_bench_hosts_logs_")
    lock = Lock(args.lock, enabled=not args.no_lock)
    holder = Holder(args, lock)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    last_seconds = 0.0

    def record(entry):
        runs.append(entry)
        if args.raw:
            with open(args.raw, "a") as handle:
                handle.write(json.dumps(entry) + "\n")

    try:
        for index, (round_index, rate, model, hosts, config) in enumerate(order):
            fresh = holder.get(rate, next_run_estimate=last_seconds)
            if fresh and not args.no_probe:
                probe = probe_link(holder.cluster, rate)
                if probe:
                    print(f"link probe {' -> '.join(holder.cluster.hosts[:2])}: {probe}", flush=True)
                    record({"kind": "link_probe", "round": round_index, "rate": rate, **probe})
            warmup, steps, slow = steps_of(args, model, rate, hosts, config)
            load = os.getloadavg()
            print(f"[{index + 1}/{len(order)}] round {round_index + 1}, link {link_name(rate)}, {model}, {hosts} "
                  f"host(s), {config}, {warmup}+{steps} steps; load before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
                  flush=True)
            log_path = os.path.join(logs, f"{index:03d}-{model}-{link_name(rate)}-{hosts}-{config}.log")
            status, ranks, seconds, tail, returncode = launch(args, holder.cluster, model, hosts, config, warmup,
                                                              steps, log_path)
            last_seconds = seconds
            entry = {"kind": "run", "round": round_index, "rate": rate, "link": link_name(rate), "model": model,
                     "hosts": hosts, "config": config, "controller": args.controller, "batch_size": args.batch_size,
                     "warmup": warmup, "steps": steps, "slow": slow, "threads": args.threads, "status": status,
                     "load_before": list(load), "launch_seconds": seconds, "returncode": returncode,
                     "log": log_path, "ranks": {str(k): v for k, v in sorted(ranks.items())}}
            if status == "ok":
                windows = [r["window"] for r in ranks.values()]
                entry["img_s_per_worker"] = args.batch_size * steps / max(windows)
                entry["img_s_each_worker"] = [args.batch_size * steps / ranks[k]["window"] for k in sorted(ranks)]
                timed = [statistics.median(ranks[k]["step_times"][warmup:]) for k in sorted(ranks)]
                entry["median_step_s"] = max(timed)
                text = (f"{entry['img_s_per_worker']:.1f} img/s per worker (each: "
                        f"{[round(v, 1) for v in entry['img_s_each_worker']]}), median step "
                        f"{1000 * entry['median_step_s']:.0f} ms")
            else:
                entry["error"] = first_error(ranks, tail) if status != "timeout" else \
                    f"no result after the {args.run_timeout:g} s run timeout"
                if config == "mwms" and status == "failed" and any(r.get("error") for r in ranks.values()):
                    entry["issue"] = MWMS_ISSUE
                entry["log_tail"] = tail[-2000:]
                text = f"{status}: {entry['error']}"
            record(entry)
            print(f"    -> {text} (launch {seconds:.1f} s)", flush=True)
    except KeyboardInterrupt as interrupt:
        print(f"interrupted ({interrupt}): tearing the cluster down", flush=True)
        raise
    finally:
        holder.give_back()
        table = make_table(args, [r for r in runs], command_line)
        print("\n" + table, flush=True)
        if args.table:
            with open(args.table, "w") as handle:
                handle.write(table + "\n")
        print(f"\nworker logs: {logs}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4], help="host counts (1 worker each)")
    parser.add_argument("--rates", type=rate_arg, nargs="+", default=[None, "1gbit", "100mbit"],
                        help="link rates: none (unlimited) or tc rates (default: none 1gbit 100mbit)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["demo", "resnet50-grad"])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-slow", type=int, default=1)
    parser.add_argument("--steps-slow", type=int, default=3)
    parser.add_argument("--slow-seconds", type=float, default=2.0,
                        help="a run is slow when its allreduce takes longer than this per step at the nominal rate")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow intra- and inter-op threads per worker")
    parser.add_argument("--run-timeout", type=float, default=300, help="seconds per launch")
    parser.add_argument("--one-host-every-link", action="store_true",
                        help="measure the 1-host runs under every rate (default: once per round)")
    parser.add_argument("--no-probe", action="store_true",
                        help="skip the TCP throughput probe after each cluster start")
    parser.add_argument("--mwms-port", type=int, default=23456)
    parser.add_argument("--raw", default=None, help="one JSON line per run (overwritten)")
    parser.add_argument("--table", default=None, help="the Markdown table, also printed")
    parser.add_argument("--lock", default="/tmp/kb_cluster_c.lock")
    parser.add_argument("--no-lock", action="store_true", help="do not wait for nor take the cluster lock")
    parser.add_argument("--max-hold", type=float, default=240,
                        help="give the cluster back between runs after holding it this long (0: never)")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--worker-hosts", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if min(args.warmup, args.warmup_slow) < 1 or min(args.steps, args.steps_slow) < 1:
        parser.error("--warmup, --warmup-slow, --steps and --steps-slow must be at least 1 (the first step traces)")
    if any(h < 1 for h in args.hosts) or max(args.hosts) > 16:
        parser.error("--hosts: 1..16")
    sys.path.insert(0, str(ROOT))
    orchestrate(args)


if __name__ == "__main__":
    main()
