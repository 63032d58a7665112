"""The boost step's cost at two revisions, side by side.

    .venv/bin/python scripts/bench_versions.py --rev fca8656 --against HEAD --rounds 3

Each round runs one process per version, taking turns, the order rotated by one per round
(`keras_boost.app.turns`, the method every benchmark shares). A
process times `BoostModel.fit` and plain `keras.Model.fit` on the demo ResNet (same
weights and data, batch 128), the two models alternating epoch by epoch, and reports the
median step of each; the ratio BoostModel / keras.Model cancels most of the machine's
noise. Both revisions are checked out with `git worktree` into temporary folders, so the
working tree can change while it runs.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from keras_boost.app import turns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = r"""
import json, os, statistics, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras, numpy as np
import keras_boost
try:
    from keras_boost.app.demo_net import demo_resnet
except ImportError:
    from keras_boost.models import demo_resnet

class Timer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__(); self.times = []
    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()
    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)

steps, batch, epochs = {steps}, 128, {epochs}
rng = np.random.default_rng(0)
x = rng.random((batch * steps, 28, 28, 1), dtype=np.float32)
y = rng.integers(0, 10, len(x)).astype(np.int32)
weights = demo_resnet().get_weights()
models = {{}}
for name, cls in (("keras", keras.Model), ("boost", keras_boost.BoostModel)):
    model = demo_resnet(model_class=cls)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    models[name] = model
times = {{name: [] for name in models}}
for epoch in range(epochs):
    for name, model in models.items():
        timer = Timer()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
        times[name].extend(timer.times[2:] if epoch == 0 else timer.times)
print("RESULT " + json.dumps({{name: statistics.median(v) for name, v in times.items()}}))
"""


def run(tree, args):
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="2")
    return turns.run_once([sys.executable, "-c", PROGRAM.format(steps=args.steps, epochs=args.epochs)],
                          cwd=tree, env=env, timeout=1200, name=tree)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the revision before, e.g. fca8656")
    parser.add_argument("--against", default="HEAD", help="the revision after (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per model and process")
    args = parser.parse_args()
    trees = {}
    for rev in (args.rev, args.against):
        trees[rev] = tempfile.mkdtemp(prefix="kb_rev_")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", trees[rev], rev], check=True,
                       capture_output=True)
    try:
        results = {rev: [] for rev in trees}
        for round_index in range(args.rounds):  # each revision in its own process (its tree), taking turns
            for rev in turns.turn_order(list(trees), round_index):
                results[rev].append(run(trees[rev], args))
        print(f"load average after: {os.getloadavg()}")
        print("| version | BoostModel step (ms) | keras.Model step (ms) | BoostModel / keras.Model (median of rounds) |")
        print("|---|---|---|---|")
        for name, rows in results.items():
            boost = statistics.median(r["boost"] for r in rows)
            plain = statistics.median(r["keras"] for r in rows)
            ratio = statistics.median(r["boost"] / r["keras"] for r in rows)
            spread = ", ".join(f"{r['boost'] / r['keras']:.3f}" for r in rows)
            print(f"| {name} | {1000 * boost:.1f} | {1000 * plain:.1f} | {ratio:.3f} ({spread}) |")
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    main()
