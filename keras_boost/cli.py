"""The `keras-boost` command: info, train."""

import argparse
import json
import os
import shutil
import subprocess
import sys


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


def _without_np(argv):
    """`argv` without its `--np N` / `--np=N` option."""
    cleaned, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--np":
            skip = True
        elif not token.startswith("--np="):
            cleaned.append(token)
    return cleaned


def _relaunch(args, argv):
    """Runs this same command on `--np` local workers under horovodrun."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        horovodrun = shutil.which("horovodrun")
    if horovodrun is None:
        print("keras-boost: --np > 1 needs horovodrun (run ./scripts/setup.sh)", file=sys.stderr)
        return 2
    cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", f"--{args.controller}",
           sys.executable, "-m", "keras_boost.cli", *_without_np(argv)]
    print("launching: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def _train(args, argv):
    from keras_boost import distributed

    if args.np > 1 and not distributed.launched():
        return _relaunch(args, argv)
    from keras_boost.training import run_training

    result = run_training(args)
    if distributed.rank() == 0:
        print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-boost",
        description="Boosted Keras training on Horovod. Start with `keras-boost info`, then "
        "`keras-boost train --np 2` to train the demo model on Fashion-MNIST on 2 workers.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, Horovod build features, AdaSum backend, world size")
    info.add_argument("--json", action="store_true", help="print one JSON object")

    train = sub.add_parser("train", help="train a model on a dataset with boost options")
    train.add_argument("--model", default="demo", choices=["demo"], help="model to train (default: demo)")
    train.add_argument("--dataset", default="fashion_mnist", choices=["fashion_mnist", "synthetic"])
    train.add_argument("--epochs", type=_positive_int, default=2)
    train.add_argument("--batch-size", type=_positive_int, default=64, help="per-worker batch size")
    train.add_argument("--lr", type=_positive_float, default=0.05, help="learning rate (SGD with momentum 0.9)")
    train.add_argument("--steps-per-epoch", type=_positive_int, default=None, help="limit batches per epoch")
    train.add_argument("--train-samples", type=_positive_int, default=None, help="use the first N training samples")
    train.add_argument("--accumulation", type=_positive_int, default=1, help="micro-batches per update")
    train.add_argument("--loss-scale", choices=["none", "dynamic"], default="none")
    train.add_argument("--precision", choices=["float32", "mixed_float16", "mixed_bfloat16"], default="float32")
    train.add_argument("--np", type=_positive_int, default=1, help="workers; >1 launches horovodrun itself")
    train.add_argument("--controller", choices=["gloo", "mpi"], default="gloo", help="Horovod controller for --np")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return parser


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return _info(args)
    return _train(args, argv)


if __name__ == "__main__":
    sys.exit(main())
