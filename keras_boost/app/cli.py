"""The `keras-boost` command: info, train."""

import argparse
import json
import subprocess
import sys

from keras_boost.app.launch import horovodrun_command, without_options


def _info(args):
    from keras_boost import distributed

    caps = distributed.capabilities()
    if args.json:
        print(json.dumps(caps))
        return 0
    print(f"TensorFlow        {caps['tensorflow']}")
    print(f"Keras             {caps['keras']}")
    print(f"Horovod           {caps['horovod'] or 'not installed (single process only)'}")
    if caps["horovod"]:
        built = [name for name in ("mpi", "gloo", "nccl") if caps[f"{name}_built"]]
        print(f"Horovod built     {', '.join(built) or 'no controllers'}")
    if caps["gpus"]:
        names = ", ".join(f"{g['device']} {g['name']}" for g in caps["gpus"])
        print(f"GPUs              {caps['physical_gpus']} on this host; this process uses {names}")
        pinning = caps["gpu_pinning"]
        if pinning:
            print(f"GPU pinning       {pinning['device']} for local rank {pinning['local_rank']} of "
                  f"{pinning['local_size']} ({pinning['how']})")
        else:
            print("GPU pinning       under a launcher, worker local_rank uses GPU local_rank only (memory growth on)")
        print(f"GPU allreduce     {caps['gpu_allreduce']}")
        print(f"GPU AdaSum        {caps['gpu_adasum']}")
    else:
        print("GPUs              none (CPU only)")
    if caps["launched"]:
        print(f"world size        {caps['size']} ({caps['controller']} controller)")
        print(f"AdaSum combine    {'native Horovod Adasum' if caps['native_adasum'] else 'exact keras_boost fallback'}")
    else:
        print("world size        1 (no launcher; run under horovodrun or mpirun for more)")
        print("AdaSum combine    native Horovod Adasum under an MPI launch with a power-of-two number of "
              "groups, the exact keras_boost fallback otherwise")
    return 0


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _relaunch(args, argv):
    """Runs this same command on `--np` local workers under horovodrun."""
    cmd = horovodrun_command(args.np, args.controller, ["-m", "keras_boost.app.cli", *without_options(argv, ("--np",))])
    if cmd is None:
        print("keras-boost: --np > 1 needs horovodrun (run ./scripts/setup.sh)", file=sys.stderr)
        return 2
    print("launching: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def _train(args, argv):
    from keras_boost import distributed

    if args.np > 1 and not distributed.launched():
        return _relaunch(args, argv)
    from keras_boost.app.training import run_training

    result = run_training(args)
    if distributed.rank() == 0:
        print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


def _bench(args, argv):
    from keras_boost.app import bench

    if args.result_json:  # one run, launched by the bench below
        bench.run_child(args)
        return 0
    if args.np > 1 and horovodrun_command(args.np, args.controller, []) is None:
        print("keras-boost: --np > 1 needs horovodrun (run ./scripts/setup.sh)", file=sys.stderr)
        return 2
    table = bench.run_bench(args, argv)
    print(table)
    print(f"table: {args.table}\nplot: {args.plot}")
    return 0


def _add_training_options(parser, epochs):
    from keras_boost.app.training import DATASETS, MODELS

    parser.add_argument("--model", default="demo", choices=MODELS, help="demo (residual CNN) or a keras.applications "
                        "family (trained from scratch on 32x32x3 copies of the images)")
    parser.add_argument("--dataset", default="fashion_mnist", choices=DATASETS,
                        help="fashion_mnist (Debian package dataset-fashion-mnist) or synthetic")
    parser.add_argument("--epochs", type=_positive_int, default=epochs)
    parser.add_argument("--batch-size", type=_positive_int, default=64, help="per-worker batch size")
    parser.add_argument("--lr", type=_positive_float, default=0.05, help="learning rate of SGD, momentum 0.9")
    parser.add_argument("--steps-per-epoch", type=_positive_int, default=None, help="limit batches per epoch")
    parser.add_argument("--train-samples", type=_positive_int, default=None, help="use the first N training samples")
    parser.add_argument("--config", default=None, help="boost configuration JSON file (AutoBoost sections and keys)")
    parser.add_argument("--accumulation", type=_positive_int, default=1, help="micro-batches per update")
    parser.add_argument("--loss-scale", choices=["none", "dynamic"], default="none")
    parser.add_argument("--precision", choices=["auto", "float32", "mixed_float16", "mixed_bfloat16"], default="auto",
                        help="auto (default): float32 on CPUs and at O0; on GPUs at O1/O2 mixed_bfloat16 (compute "
                        "capability >= 8.0) or mixed_float16 with dynamic loss scaling (7.x); "
                        "see docs/getting-started.md")
    parser.add_argument("--np", type=_positive_int, default=1, help="workers; > 1 launches horovodrun itself")
    parser.add_argument("--controller", choices=["gloo", "mpi"], default="gloo", help="Horovod controller for --np")
    parser.add_argument("--seed", type=int, default=0)


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-boost",
        description="Boosted Keras training on Horovod. Start with `keras-boost info`, then "
        "`keras-boost train --np 2 --level O1` to train the demo model on Fashion-MNIST on 2 workers, "
        "and `keras-boost bench` to compare the levels O0/O1/O2 side by side.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, Horovod build features, AdaSum backend, world size")
    info.add_argument("--json", action="store_true", help="print one JSON object")

    train = sub.add_parser("train", help="train a model on a dataset at a boost level")
    _add_training_options(train, epochs=2)
    train.add_argument("--level", choices=["O0", "O1", "O2"], default="O0", help="boost level (default O0)")
    train.add_argument("--checkpoint-dir", default=None, help="save weights there every epoch (rank 0) and resume "
                       "from them when present")
    train.add_argument("--json", action="store_true", help="print the result as one JSON object")

    bench = sub.add_parser("bench", help="train at several levels side by side; write a Markdown table and a PNG")
    _add_training_options(bench, epochs=3)
    bench.add_argument("--levels", nargs="+", choices=["O0", "O1", "O2"], default=["O0", "O1", "O2"])
    bench.add_argument("--table", default="bench.md", help="Markdown table output (default bench.md)")
    bench.add_argument("--plot", default="bench.png", help="PNG plot of test accuracy against wall time")
    bench.add_argument("--rounds", type=_positive_int, default=1, help="repeat every level this many times, "
                       "the levels taking turns (each run is its own process)")
    bench.add_argument("--seeds", type=int, nargs="+", default=None, help="run every level with each of these "
                       "seeds (default: --seed)")
    bench.add_argument("--run-timeout", type=_positive_float, default=3600, help="seconds one run may take")
    bench.add_argument("--raw", default=None, help="also write every run (epoch and step times, test accuracy "
                       "per epoch, boost report) to this file, one JSON object per line")
    bench.add_argument("--result-json", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    commands = {"info": lambda: _info(args), "train": lambda: _train(args, argv), "bench": lambda: _bench(args, argv)}
    return commands[args.command]()


if __name__ == "__main__":
    sys.exit(main())
