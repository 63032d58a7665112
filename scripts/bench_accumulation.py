"""Cost of gradient accumulation on the demo ResNet (28x28x1, Fashion-MNIST).

Run from the repository root:

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python scripts/bench_accumulation.py

It measures, side by side in one run:

1. single process, fixed micro-batch (default 64), N = 1, 2, 4, 8 micro-batches per
   update: training throughput (samples/s, after a warm-up) and peak resident memory
   (`resource.getrusage` maxrss). Every N runs in a fresh subprocess, so the peak is
   that configuration's own.
2. 2 workers (`horovodrun -np 2 --gloo`, started by this script): the time of one fused
   allreduce of the demo model's gradient list inside a `tf.function` (the one collective
   of an update), and what it costs per sample when an update carries N=1 or N=4
   micro-batches per worker (time / (micro-batch x N x workers)).

It prints a Markdown table, the command and the load average (the machine may be shared).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COMMAND = "TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python scripts/bench_accumulation.py"


def load_data(n):
    from keras_boost.app.data import load_fashion_mnist, synthetic

    try:
        x, y = load_fashion_mnist("train")
        return x[:n], y[:n], "Fashion-MNIST"
    except FileNotFoundError:
        x, y = synthetic(n)
        return x, y, "synthetic"


def single(accumulation, micro_batch, windows, repeats):
    """One configuration in this process; prints one JSON line."""
    import keras

    from keras_boost.app.demo_net import demo_resnet

    keras.utils.set_random_seed(0)
    samples = micro_batch * 8 * windows  # whole windows for every N in 1, 2, 4, 8
    x, y, source = load_data(samples)
    model = demo_resnet()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  gradient_accumulation=accumulation)
    model.fit(x[:micro_batch * 8], y[:micro_batch * 8], batch_size=micro_batch, epochs=1, shuffle=False,
              verbose=0)  # warm-up: trace, and one full window for N <= 8
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.fit(x, y, batch_size=micro_batch, epochs=1, shuffle=False, verbose=0)
        times.append(time.perf_counter() - start)
    best = min(times)
    params = sum(int(v.shape.num_elements()) for v in model.trainable_weights)
    print(json.dumps({
        "N": accumulation, "micro_batch": micro_batch, "samples": samples, "source": source,
        "updates": samples // (micro_batch * accumulation),
        "samples_per_s": samples / best, "samples_per_s_median": samples / statistics.median(times),
        "ms_per_sample": 1e3 * best / samples,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "accumulator_mb": 4 * params / 2**20 if accumulation > 1 else 0.0, "params": params,
    }), flush=True)


def comm(micro_batch, iters):
    """Under horovodrun: times the fused allreduce of the demo model's gradients; rank 0 prints JSON."""
    import numpy as np
    import tensorflow as tf

    from keras_boost import distributed
    from keras_boost.app.demo_net import demo_resnet

    distributed.init()
    shapes = [tuple(v.shape) for v in demo_resnet().trainable_weights]
    rng = np.random.default_rng(distributed.rank())
    grads = [tf.constant(rng.normal(size=s) * 1e-3, tf.float32) for s in shapes]

    @tf.function
    def reduce(ts):
        return distributed.grouped_allreduce(ts, average=True)

    for _ in range(5):
        reduce(grads)
    times = []
    for _ in range(iters):
        distributed.barrier()
        start = time.perf_counter()
        out = reduce(grads)
        _ = out[0].numpy()
        times.append(time.perf_counter() - start)
    # the slowest rank's median counts
    median = float(distributed.allreduce(tf.constant(statistics.median(times)), average=False).numpy())
    slowest = max(distributed.allgather(tf.constant([statistics.median(times)])).numpy().tolist())
    if distributed.rank() == 0:
        size = distributed.size()
        print("BENCH_COMM " + json.dumps({
            "workers": size, "tensors": len(shapes), "values": int(sum(np.prod(s) for s in shapes)),
            "allreduce_ms_median": 1e3 * slowest, "allreduce_ms_mean_of_ranks": 1e3 * median / size,
            "per_sample_us": {str(n): 1e6 * slowest / (micro_batch * n * size) for n in (1, 4)},
        }), flush=True)


def run_all(args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    load_before = os.getloadavg()
    rows = []
    for n in args.accumulations:
        cmd = [sys.executable, os.path.abspath(__file__), "--single", str(n), "--micro-batch", str(args.micro_batch),
               "--windows", str(args.windows), "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(f"N={n}: {rows[-1]['samples_per_s']:.0f} samples/s, peak RSS {rows[-1]['peak_rss_mb']:.0f} MB",
              file=sys.stderr, flush=True)
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, os.path.abspath(__file__),
           "--comm", "--micro-batch", str(args.micro_batch), "--iters", str(args.iters)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    comm_result = json.loads(next(line for line in out.splitlines() if "BENCH_COMM " in line)
                             .split("BENCH_COMM ", 1)[1])
    load_after = os.getloadavg()

    base = rows[0]
    print("\n| N (micro-batches per update) | micro-batch | samples/s (best of %d) | vs N=1 | ms/sample | "
          "peak RSS (MB) | accumulators (MB) |" % args.repeats)
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']} | {r['micro_batch']} | {r['samples_per_s']:.0f} | "
              f"{r['samples_per_s'] / base['samples_per_s']:.2f}x | {r['ms_per_sample']:.3f} | "
              f"{r['peak_rss_mb']:.0f} | {r['accumulator_mb']:.2f} |")
    print(f"\nModel: demo_resnet, {base['params']} trainable values, data: {base['source']}, "
          f"{base['samples']} samples per timed epoch, SGD momentum 0.9, one process.")
    print(f"\n2 workers (horovodrun --gloo), one fused allreduce of the {comm_result['tensors']} gradient tensors "
          f"({comm_result['values']} float32 values): median {comm_result['allreduce_ms_median']:.2f} ms per update "
          f"(slowest rank, {args.iters} calls).\n")
    print("| N | samples per update (2 workers x micro-batch x N) | allreduce time per sample (us) | "
          "share of the 1-process compute time per sample |")
    print("|---|---|---|---|")
    compute_us = 1e3 * base["ms_per_sample"]
    for n in (1, 4):
        us = comm_result["per_sample_us"][str(n)]
        print(f"| {n} | {2 * args.micro_batch * n} | {us:.2f} | {100 * us / compute_us:.1f}% |")
    print(f"\nLoad average (1, 5, 15 min) before: {', '.join(f'{v:.2f}' for v in load_before)}; "
          f"after: {', '.join(f'{v:.2f}' for v in load_after)}; CPUs: {os.cpu_count()}.")
    print(f"\nCommand: `{COMMAND}" + (f" {' '.join(sys.argv[1:])}" if sys.argv[1:] else "") + "`")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--comm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--accumulations", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--windows", type=int, default=2, help="windows of N=8 per timed epoch")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per configuration")
    parser.add_argument("--iters", type=int, default=30, help="timed allreduce calls")
    args = parser.parse_args()
    if args.single is not None:
        single(args.single, args.micro_batch, args.windows, args.repeats)
    elif args.comm:
        comm(args.micro_batch, args.iters)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
