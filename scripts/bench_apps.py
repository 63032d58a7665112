"""Epoch and first-step time of keras.applications models: keras.Model against BoostModel levels.

    .venv/bin/python scripts/bench_apps.py --model resnet50 --configs keras O0 O1 --rounds 2
    .venv/bin/python scripts/bench_apps.py --model demo --configs keras O0 O1 --venvs .venv-tf2.18.1 .venv

Every configuration runs in its own process (a fresh TensorFlow, nothing shared), the
configurations take turns round after round, their order rotated by one per round
(`keras_boost.app.turns`, the method every benchmark shares), and each process trains
with `fit` as users call it: `--epochs` epochs of `--steps` steps of batch `--batch-size` on 32x32x3 inputs
(28x28x1 for mnist_convnet and demo; for text_transformer, keras-io's text classification
transformer, 200 tokens of a 20000-word vocabulary) (random data: this measures speed, not accuracy). Reported per configuration: the median
step time after the first epoch (each run's mean step without each epoch's first step,
which also starts the epoch, and without the steps that traced a function; then the median
and range over the rounds: a freeze group traced when it first trains is one slow step,
which this leaves out and the whole-fit time keeps), the median epoch time after the first, the first
step (from `fit`'s start to the end of step 0: tracing and graph optimisation), the first
epoch and the whole fit. Beside the wall-clock step, the process's CPU time per step (all
threads; the same statistic): the work a step does, which another machine's load moves
less than the wall clock, and the ratios against the first configuration given.

On CPUs without AVX-512, TensorFlow 2.18 leaves oneDNN off; its Eigen
`Conv2DBackpropInput` then takes ~300 ms per 3x3 convolution on ResNet50's 1x1 maps
(80% of the step). `TF_ENABLE_ONEDNN_OPTS=1` in the environment turns oneDNN on for every
process (docs/benchmarks.md); the table's header says which was used.

Configurations (`--configs`):
    keras        plain keras.Model (the reference without keras_boost)
    O0, O1, O2   BoostModel(boost_level=...) with the level's defaults (keras_boost's); in a fit too
                 short to repay the freeze groups' compilation (the default 40 steps; 3 x 30 on
                 ResNet50) the level's freezing switches itself off at the third step
                 (docs/auto_boost.md): use more steps, or O1-fixed, to measure it
    O1-mindspore O1 with MindSpore's defaults (GC on, interval freezing over 10 groups)
    O1-fixed     O1 without self-measurement (every stage of the level stays on, no gate)
    O1-noahead   O1 with KERAS_BOOST_TRACE_AHEAD=0 (each freeze group's step traced when it first trains)
    O1-nofused   O1 with {"boost": {"fused_update": False}}: Keras' own optimizer update (separate tensor ops)
    O1-nofusedbn O1 with {"boost": {"fused_batchnorm": False}}: Keras' own BatchNormalization ops
    O1-nocm      O1 with {"boost": {"conv_matmul": False}}: one-pixel convolutions stay convolutions
    O1-nofreeze  O1 without gradient freezing (manual mode: LessBN and its companions, the fused update)
    O0-guard     O0 with compile(nan_guard=True): the finiteness check of the averaged gradients
                 before every update (off by default since December 5, 2026)
    O0-noguard   O0 with compile(nan_guard=False): the default, said explicitly
    O0-fused     O0 with compile(fused_update=True): the optimizer's update through TensorFlow's fused kernels
    O0-fusedbn   O0 with compile(fused_batchnorm=True): BatchNormalization through TensorFlow's fused kernel
    O0-cm        O0 with compile(conv_matmul=True): convolutions with a one-pixel output as matrix products
    O0-scale-fixed, O0-scale-dynamic
                 O0 with loss scaling (FixedLossScale(1024), DynamicLossScale()) in float32
    O1-nogc      O1-mindspore without gradient centralization
    O1-cont      no GC, the continuous freeze strategy over 10 groups
    O1-cont4     no GC, the continuous freeze strategy over 4 groups (keras_boost's O1 defaults)
    lessbn       O1 with LessBN and the FN head only (no GC, no freezing)
    lessbn-gc    O1 with LessBN, FN head and GC (no freezing)
    freeze       gradient freezing only (MindSpore's defaults: 10 groups, freeze_p 0.7)
    freeze-p1    gradient freezing with freeze_p=1.0 (every step trains every variable)
    group-K      BoostModel whose every step trains freeze group K of 10 (FreezeOpt, sequence [K])
    hand-K       the reference for group-K: a keras.Model whose hand-written train_step takes
                 the gradients of group K's variables only and applies them (no keras_boost)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import bench_common  # noqa: F401,E402 (first: this checkout's keras_boost on sys.path, not the installed one)
from keras_boost.app import turns
from keras_boost.app.bench import steady_step  # noqa: F401 (the step statistic, shared with keras-boost bench)
from keras_boost.config import MINDSPORE_DEFAULTS

FAMILIES = ("resnet50", "resnet50v2", "mobilenetv2", "densenet121", "efficientnetb0", "mnist_convnet", "demo",
            "text_transformer", "timeseries")
# keras.applications at 32x32x3; keras-io's mnist_convnet and keras_boost's demo network at 28x28x1;
# keras-io's timeseries FCN on series of 28 steps of 28 values;
# keras-io's text transformer on sequences of 200 tokens of a 20000-word vocabulary
INPUT_SHAPES = {"mnist_convnet": (28, 28, 1), "demo": (28, 28, 1), "text_transformer": (200,), "timeseries": (28, 28)}
VOCABULARY = 20000
O1_NO_FREEZE = {"boost": {"mode": "manual", "less_bn": True, "grad_freeze": False}}
# MindSpore's values where keras_boost's defaults differ, named so that these configurations
# mean what docs/benchmarks.md says whatever keras_boost's defaults are.
MINDSPORE_LESS_BN, MINDSPORE_FREEZE = MINDSPORE_DEFAULTS["less_bn"], MINDSPORE_DEFAULTS["grad_freeze"]
FREEZE_ONLY = {"mode": "manual", "less_bn": False, "grad_freeze": True}
CONFIGS = {
    "keras": ("keras", None),
    "O0": ("O0", None),
    "O1": ("O1", None),
    "O2": ("O2", None),
    "O1-mindspore": ("O1", MINDSPORE_DEFAULTS),
    "O1-fixed": ("O1", {"boost": {"measure": False}}),
    "O1-noahead": ("O1", None),  # KERAS_BOOST_TRACE_AHEAD=0: each freeze group traced when it first trains
    "O1-nofused": ("O1", {"boost": {"fused_update": False}}),
    "O1-nofreeze": ("O1", O1_NO_FREEZE),
    "O1-nofusedbn": ("O1", {"boost": {"fused_batchnorm": False}}),
    "O1-nocm": ("O1", {"boost": {"conv_matmul": False}}),
    "O0-guard": ("O0", None),
    "O0-noguard": ("O0", None),
    "O0-fused": ("O0", None),
    "O0-fusedbn": ("O0", None),
    "O0-cm": ("O0", None),
    "O1-nogc": ("O1", {"less_bn": {**MINDSPORE_LESS_BN, "gc_flag": False}, "grad_freeze": MINDSPORE_FREEZE}),
    "O1-cont": ("O1", {"less_bn": {"gc_flag": False}, "grad_freeze": {"freeze_type": 0, "param_groups": 10}}),
    "O1-cont4": ("O1", {"less_bn": {"gc_flag": False}, "grad_freeze": {"freeze_type": 0, "param_groups": 4}}),
    "lessbn": ("O1", {**O1_NO_FREEZE, "less_bn": {"fn_flag": True, "gc_flag": False}}),
    "lessbn-gc": ("O1", {**O1_NO_FREEZE, "less_bn": {"fn_flag": True, "gc_flag": True}}),
    "freeze": ("O1", {"boost": FREEZE_ONLY, "grad_freeze": MINDSPORE_FREEZE}),
    "freeze-p1": ("O1", {"boost": FREEZE_ONLY, "grad_freeze": {**MINDSPORE_FREEZE, "freeze_p": 1.0}}),
    "O0-scale-fixed": ("O0", None),
    "O0-scale-dynamic": ("O0", None),
}


def compile_options(config):
    """The compile options a configuration adds (the boost options of the O0-* configurations)."""
    from keras_boost import DynamicLossScale, FixedLossScale

    return {"O0-guard": lambda: {"nan_guard": True},
            "O0-noguard": lambda: {"nan_guard": False},
            "O0-fused": lambda: {"fused_update": True},
            "O0-fusedbn": lambda: {"fused_batchnorm": True},
            "O0-cm": lambda: {"conv_matmul": True},
            "O0-scale-fixed": lambda: {"loss_scale": FixedLossScale(1024.0)},
            "O0-scale-dynamic": lambda: {"loss_scale": DynamicLossScale()}}.get(config, dict)()


def application(family, input_shape=None, classes=10):
    import keras

    input_shape = input_shape or INPUT_SHAPES.get(family, (32, 32, 3))
    if family == "mnist_convnet":  # keras-io's examples/vision/mnist_convnet.py, as written there
        from keras_boost.app.recipes import mnist_convnet

        return mnist_convnet(input_shape, classes)
    if family == "text_transformer":
        return text_transformer(input_shape[0], classes)
    if family == "timeseries":  # keras-io's timeseries_classification_from_scratch.py (its FCN), 28 steps of 28 values
        from keras_boost.app.recipes import timeseries_fcn

        return timeseries_fcn(*input_shape, classes=classes)
    if family == "demo":
        from keras_boost.app.demo_net import demo_resnet

        return demo_resnet(input_shape=input_shape, classes=classes, model_class=keras.Model)
    constructors = {
        "resnet50": keras.applications.ResNet50,
        "resnet50v2": keras.applications.ResNet50V2,
        "mobilenetv2": keras.applications.MobileNetV2,
        "densenet121": keras.applications.DenseNet121,
        "efficientnetb0": keras.applications.EfficientNetB0,
    }
    return constructors[family](weights=None, input_shape=input_shape, classes=classes)


def text_transformer(maxlen, classes):
    """keras-io's examples/nlp/text_classification_with_transformer.py, as written there
    (`keras_boost.app.recipes.text_transformer`: MultiHeadAttention, LayerNorm, two Embedding
    tables, whose gradients are `tf.IndexedSlices`), `classes` outputs."""
    from keras_boost.app.recipes import text_transformer as keras_io_transformer

    return keras_io_transformer(maxlen=maxlen, vocab_size=VOCABULARY, classes=classes)


def sample_inputs(family, n, rng):
    """`n` random inputs of `family`: tokens for the text family, values in [0, 1) for the others."""
    import numpy as np

    shape = INPUT_SHAPES.get(family, (32, 32, 3))
    if family == "text_transformer":
        return rng.integers(0, VOCABULARY, (n, *shape)).astype(np.int32)
    return rng.random((n, *shape), dtype=np.float32)


def _group_config(config):
    kind, _, group = config.partition("-")
    if kind in ("group", "hand") and group.isdigit() and int(group) < 10:
        return kind, int(group)
    return None


def config_name(text):
    if text in CONFIGS or _group_config(text):
        return text
    raise argparse.ArgumentTypeError(f"unknown configuration {text!r}: one of {sorted(CONFIGS)}, group-K or hand-K "
                                     "(K in 0..9)")


def hand_written_group_model(base, variables):
    """A keras.Model whose train_step takes the gradients of `variables` only (Keras' own pattern)."""
    import keras
    import tensorflow as tf

    class GroupStep(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch([v.value for v in variables])
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            grads = tape.gradient(loss, [v.value for v in variables])
            self.optimizer.apply(grads, variables)
            return self.compute_metrics(x, y, y_pred)

    return GroupStep(base.inputs, base.outputs)


def build(family, config, seed=0):
    """The model of `config` on `family`, compiled as the benchmark trains it."""
    import keras

    from keras_boost import BoostModel, FreezeOpt, split_parameters_groups

    keras.utils.set_random_seed(seed)
    base = application(family)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    loss = keras.losses.SparseCategoricalCrossentropy()
    grouped = _group_config(config)
    if grouped:
        kind, group = grouped
        groups = split_parameters_groups(base, 10)
        if kind == "hand":
            model = hand_written_group_model(base, groups[group])
            model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
        else:
            model = BoostModel(base.inputs, base.outputs)  # the same layers, so the same variables
            model.compile(optimizer=FreezeOpt(optimizer, groups, [group]), loss=loss, metrics=["accuracy"])
        return model
    level, boost_config = CONFIGS[config]
    if config == "O1-noahead":
        os.environ["KERAS_BOOST_TRACE_AHEAD"] = "0"
    if level == "keras":
        model = keras.Model(base.inputs, base.outputs)
    else:
        model = BoostModel(base.inputs, base.outputs, boost_level=level, boost_config=boost_config)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"], **compile_options(config))
    return model


def worker(args):
    """One configuration in this process; prints one JSON line of times."""
    import keras
    import numpy as np

    from keras_boost import distributed

    model = build(args.model, args.worker)
    rng = np.random.default_rng(distributed.rank())
    x = sample_inputs(args.model, args.steps * args.batch_size, rng)
    y = rng.integers(0, 10, len(x))

    class Times(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epochs, self.steps, self.cpu_steps, self.first_step = [], [], [], None

        def on_train_begin(self, logs=None):
            self.start = time.perf_counter()

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch_start = self.step_start = time.perf_counter()
            self.cpu_start = time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            now, cpu = time.perf_counter(), time.process_time()
            if self.first_step is None:
                self.first_step = now - self.start
            elif self.epochs:  # steps after the first epoch
                self.steps.append(now - self.step_start)
                self.cpu_steps.append(cpu - self.cpu_start)
            self.step_start, self.cpu_start = now, cpu

        def on_epoch_end(self, epoch, logs=None):
            self.epochs.append(time.perf_counter() - self.epoch_start)

    times = Times()
    start = time.perf_counter()
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=0, callbacks=[times])
    if distributed.rank() != 0:
        return
    print("RESULT " + json.dumps({"self_measurement": getattr(model, "self_measurement", None),
                                  "epochs": times.epochs, "steps": times.steps, "cpu_steps": times.cpu_steps,
                                  "first_step": times.first_step,
                                  "fit": time.perf_counter() - start}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=FAMILIES, default="resnet50")
    parser.add_argument("--configs", nargs="+", type=config_name, default=["keras", "O0", "O1"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="steps per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--np", type=int, default=1,
                        help="workers per configuration (horovodrun --gloo on this machine); keras needs 1")
    parser.add_argument("--raw", default=None, help="append every run's step and epoch times to this JSON-lines file")
    parser.add_argument("--venvs", nargs="+", default=None, metavar="VENV",
                        help="run every configuration in each of these environments (e.g. .venv-tf2.18.1 .venv: "
                        "two TensorFlow versions side by side); a row is then CONFIG@TENSORFLOW")
    parser.add_argument("--worker", type=config_name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.np > 1 and "keras" in args.configs:
        parser.error("--np > 1: a plain keras.Model does not average gradients across workers; compare with O0")
    pythons = {}  # row name -> (configuration, the Python that runs it)
    for venv in args.venvs or [None]:
        python = sys.executable if venv is None else os.path.join(os.path.abspath(venv), "bin", "python")
        label = "" if venv is None else "@" + subprocess.run(
            [python, "-c", "import tensorflow as tf; print(tf.__version__)"], capture_output=True, text=True,
            check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).stdout.strip().splitlines()[-1]
        for config in args.configs:
            pythons[config + label] = (config, python)
    args.configs = list(pythons)
    results = {config: {key: [] for key in ("step", "cpu_step", "epoch", "first_step", "first_epoch", "fit")}
               for config in args.configs}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")

    def command(name, round_index):
        config, python = pythons[name]
        command = [python, os.path.abspath(__file__), "--worker", config, "--model", args.model,
                   "--epochs", str(args.epochs), "--steps", str(args.steps), "--batch-size", str(args.batch_size)]
        if args.np > 1:
            horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
            command = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo", *command]
        return command

    def report(config, round_index, result):
        results[config]["step"].append(steady_step(result["steps"], args.steps))
        results[config]["cpu_step"].append(steady_step(result["cpu_steps"], args.steps))
        if args.raw:
            with open(args.raw, "a") as raw:
                raw.write(json.dumps({"round": round_index, "config": config, **result}) + "\n")
        results[config]["epoch"].append(statistics.median(result["epochs"][1:]))
        results[config]["first_step"].append(result["first_step"])
        results[config]["first_epoch"].append(result["epochs"][0])
        results[config]["fit"].append(result["fit"])
        print(f"round {round_index + 1} {config}: step {1000 * results[config]['step'][-1]:.0f} ms, "
              f"epochs {[round(e, 2) for e in result['epochs']]}, first step {result['first_step']:.2f} s",
              flush=True)
        for option, kept, numbers in result["self_measurement"] or ():
            print(f"    self-measurement: {option} {'stays on' if kept else 'switched off'}: {numbers}", flush=True)

    # under horovodrun, rank 0's result line starts with "[0]<stdout>:"; turns.result_line allows it
    turns.take_turns(args.configs, args.rounds, command, timeout=args.timeout, env=env, report=report)
    print_table(args, results)


def print_table(args, results):
    """Medians over the rounds, with their range; ratios against the first configuration."""
    reference = args.configs[0]
    median = {config: {key: statistics.median(v) for key, v in values.items()} for config, values in results.items()}
    ref = median[reference]
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "TensorFlow's default")
    workers = f"{args.np} workers (horovodrun --gloo) per configuration" if args.np > 1 else "one process"
    print(f"\n{args.model}, {workers}, batch {args.batch_size}, {args.steps} steps per epoch, {args.epochs} epochs, "
          f"{args.rounds} rounds (one process each, taking turns, order rotated per round), TF_ENABLE_ONEDNN_OPTS={onednn}; "
          f"ratios against {reference}")
    print(f"| configuration | step after the first epoch (mean; median, range over rounds) | speed vs {reference} | "
          f"CPU time per step | vs {reference} | epoch after the first | first step | first step / {reference} | "
          "first epoch | whole fit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config, values in results.items():
        m = median[config]
        steps_ms = [1000 * v for v in values["step"]]
        print(f"| {config} | {1000 * m['step']:.0f} ms ({turns.spread(steps_ms, 0)}) | {ref['step'] / m['step']:.2f}x | "
              f"{1000 * m['cpu_step']:.0f} ms | {ref['cpu_step'] / m['cpu_step']:.2f}x | "
              f"{m['epoch']:.2f} s | {m['first_step']:.1f} s | {m['first_step'] / ref['first_step']:.2f}x | "
              f"{m['first_epoch']:.1f} s | {m['fit']:.1f} s |")

if __name__ == "__main__":
    main()
