"""Throughput of plain keras.Model against BoostModel O0/O1/O2, float32 and mixed precision.

The benchmark of scripts/gpu_check.sh: ResNet50 at 224x224 on synthetic data by default,
one process, or every worker of a horovodrun launch (then BoostModel rows only: a plain
keras.Model does not communicate). Each configuration trains `--warmup + --steps` batches;
the table gives the median step time of the last `--steps` (tracing excluded) and the
images per second of all workers together. Rank 0 appends the rows to `--out`.

    python scripts/bench_gpu.py --out bench.md                       # 1 process, 8 configurations
    horovodrun -np 2 -H localhost:2 python scripts/bench_gpu.py --out bench.md --runners O0 O1 O2
    python scripts/bench_gpu.py --model demo --steps 2 --warmup 1 --batch-size 8   # CPU smoke run

`--precisions float32 mixed`: "mixed" is the policy `--precision auto` picks at O1 on this
machine's GPU (mixed_bfloat16 from compute capability 8.0, mixed_float16 on 7.x with
dynamic loss scaling), and mixed_bfloat16 on a CPU.
"""

import argparse
import os
import statistics
import sys
import time

import bench_common  # noqa: F401  (the repository on sys.path)
from bench_common import StepTimer

import keras
import numpy as np
import tensorflow as tf

from keras_boost import BoostModel, distributed
from keras_boost.app.demo_net import demo_resnet
from keras_boost.precision import gpu_compute_capabilities, resolve_precision

RUNNERS = ("keras", "O0", "O1", "O2")


def mixed_policy():
    """The policy `--precision auto` uses at O1 here; mixed_bfloat16 on a CPU."""
    policy = resolve_precision("auto", "O1")
    return "mixed_bfloat16" if policy == "float32" and not gpu_compute_capabilities() else policy


def build(model_name, image_size, runner):
    keras.utils.set_random_seed(0)
    if model_name == "demo":
        base = demo_resnet(model_class=keras.Model)
    else:
        base = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3), classes=10,
                                           classifier_activation=None)
    if runner == "keras":
        return base
    return BoostModel(base.inputs, base.outputs, name=base.name, boost_level=runner,
                      boost_config={"grad_freeze": {"total_steps": 1000}})


def run(args, runner, precision):
    keras.backend.clear_session()
    policy = "float32" if precision == "float32" else mixed_policy()
    keras.config.set_dtype_policy(policy)
    model = build(args.model, args.image_size, runner)
    shape = model.inputs[0].shape[1:]
    rng = np.random.default_rng(distributed.rank())
    x = rng.normal(size=(args.batch_size, *shape)).astype(np.float32)
    y = rng.integers(0, 10, size=(args.batch_size,)).astype(np.int32)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = SyncedStepTimer()
    model.fit(data, steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0, callbacks=[timer])
    measured = timer.times[args.warmup:]
    step = statistics.median(measured)
    return {"runner": runner, "policy": policy, "step_s": step, "first_s": sum(timer.times[:args.warmup]),
            "images_per_s": args.batch_size * distributed.size() / step}


class SyncedStepTimer(StepTimer):
    """StepTimer that waits for the step's result, so GPU steps are timed to their end."""

    def on_train_batch_end(self, batch, logs=None):
        if logs and "loss" in logs:
            float(np.asarray(logs["loss"]))
        super().on_train_batch_end(batch, logs)


def device_name():
    gpus = distributed.gpus()
    if gpus:
        return gpus[0]["name"]
    return "CPU"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "demo"], default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps (tracing)")
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS))
    parser.add_argument("--precisions", nargs="+", choices=["float32", "mixed"], default=["float32", "mixed"])
    parser.add_argument("--out", default="bench_gpu.md", help="Markdown table, appended to")
    parser.add_argument("--deadline", type=float, default=None,
                        help="Unix time after which no new configuration starts (marked 'skipped: time')")
    args = parser.parse_args(argv)
    # pins this worker's GPU first; O2's AdaSum groups are Horovod process sets
    distributed.init(process_sets=True if "O2" in args.runners else None)
    runners = [r for r in args.runners if not (r == "keras" and distributed.size() > 1)]
    table = Table(args) if distributed.rank() == 0 else None
    for precision in args.precisions:
        for runner in runners:
            if args.deadline is not None and time.time() > args.deadline:
                row = {"runner": runner, "policy": precision, "skipped": True}
            else:
                row = run(args, runner, precision)
            if table is not None:
                print(f"[bench] {row}", flush=True)
                table.add(row)  # written at once: a run stopped later keeps its finished rows
    return 0


class Table:
    """The Markdown table in `args.out`: a header when the file is new, then one row per configuration."""

    def __init__(self, args):
        self.path, self.size, self.reference = args.out, distributed.size(), {}
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            size = "28x28x1" if args.model == "demo" else f"{args.image_size}x{args.image_size}"
            self._write(f"{args.model} at {size}, batch {args.batch_size} per worker, synthetic data, median step "
                        f"of {args.steps} steps after {args.warmup} warm-up steps, on {device_name()}.\n\n"
                        "| workers | runner | precision | step (ms) | images/s (all workers) | speed-up vs first row "
                        "of its precision | warm-up incl. tracing (s) |\n|---|---|---|---|---|---|---|\n")

    def _write(self, text):
        with open(self.path, "a") as handle:
            handle.write(text)

    def add(self, row):
        if row.get("skipped"):
            self._write(f"| {self.size} | {row['runner']} | {row['policy']} | skipped: time budget | | | |\n")
            return
        kind = "float32" if row["policy"] == "float32" else "mixed"
        reference = self.reference.setdefault(kind, row)
        speedup = reference["step_s"] / row["step_s"]
        self._write(f"| {self.size} | {row['runner']} | {row['policy']} | {1000 * row['step_s']:.1f} | "
                    f"{row['images_per_s']:.0f} | {speedup:.2f}x | {row['first_s']:.1f} |\n")


if __name__ == "__main__":
    sys.exit(main())
