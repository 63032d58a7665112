"""The `keras-boost` command: info, train, bench, build-horovod."""

import argparse
import json
import os
import shlex
import sys

from keras_boost.app import launch, preflight
from keras_boost.app.launch import LAUNCH_OPTIONS, horovodrun_command, without_options
from keras_boost._validation import positive_int_arg

# Options that choose where the workers run: the launcher uses them, the workers get none
# (a --hostfile need not exist on the other hosts).


def _preflight(args):
    report = preflight.run_preflight(args.hosts, network_interface=args.network_interface, timeout=args.timeout)
    print(json.dumps(report) if args.json else preflight.format_report(report), flush=True)
    return 0 if report["ok"] else 1


def _info(args):
    if args.hosts:
        return _preflight(args)
    from keras_boost import distributed

    from keras_boost.step import registry

    caps = distributed.capabilities()
    stage_info = [line for cls in registry.stage_classes() for line in cls.launch_info(caps)]
    if args.json:
        print(json.dumps({**caps, **{key: value for key, _, value, _ in stage_info}}))
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
    else:
        print("GPUs              none (CPU only)")
    if caps["launched"]:
        print(f"world size        {caps['size']} ({caps['controller']} controller)")
    else:
        print("world size        1 (no launcher; run under horovodrun or mpirun for more)")
    for _, label, _, text in stage_info:  # what the build allows each feature
        print(f"{label:<17} {text}")
    if caps["horovod"]:
        comm = distributed.communication()
        print(f"tensor fusion     {comm['fusion_threshold_mb']:g} MiB ({comm['source']['fusion_threshold']}), cycle "
              f"{comm['cycle_time_ms']:g} ms ({comm['source']['cycle_time']}), autotune "
              f"{'on' if comm['autotune'] else 'off'}; see docs/communication.md")
    return 0


def _non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {value}")
    return value


def positive_float(text):
    """argparse type: a positive number (a learning rate, a timeout); also used by scripts/bench_adasum_convergence.py."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _level_spec(text):
    from keras_boost.app.bench import parse_level

    try:
        parse_level(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _hosts_list(text):
    try:
        return launch.parse_hosts(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _hostfile(path):
    try:
        return launch.parse_hostfile(path)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _interface(text):
    if not text or any(c.isspace() or c in ",/:" for c in text):
        raise argparse.ArgumentTypeError(f"expected one network interface name (e.g. eth0), got {text!r}")
    return text


def _add_host_options(parser, launching=True):
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", type=_hosts_list, default=None, metavar="HOST:SLOTS,...",
                       help="hosts and their worker slots, horovodrun's -H (e.g. node1:4,node2:4)"
                       + ("; --np defaults to the sum of the slots" if launching else ""))
    where.add_argument("--hostfile", type=_hostfile, default=None, dest="hostfile", metavar="FILE",
                       help=f"the hosts in a file: {launch.HOSTFILE_FORM}")
    parser.add_argument("--network-interface", type=_interface, default=None, metavar="IFACE",
                        help="the interface the workers talk over (horovodrun's --network-interface: Gloo's "
                        "interface, Open MPI's btl_tcp_if_include, NCCL_SOCKET_IFNAME); default: the interface "
                        "horovodrun finds on every host" if launching else
                        "check that this interface is on every host, on one subnet")


def _hosts_from_slurm(args):
    """Inside a Slurm allocation, `train`/`bench` without --hosts, --hostfile or --np run on its hosts and slots."""
    from keras_boost import distributed

    if args.command not in ("train", "bench") or args.hosts or args.hostfile or args.np is not None \
            or distributed.launched():
        return
    hosts = launch.slurm_hosts()
    if hosts and (len(hosts) > 1 or hosts[0][1] > 1):
        args.hosts = hosts
        print(f"keras-boost: the hosts of Slurm job {os.environ.get('SLURM_JOB_ID', '?')}: "
              f"{launch.hosts_argument(hosts)}", flush=True)


def _resolve_hosts(parser, args):
    """One host list in `args.hosts` (from --hosts or --hostfile) and `args.np` resolved against it."""
    args.hosts = args.hosts or args.hostfile
    if hasattr(args, "np"):
        try:
            args.np = launch.resolve_np(args.np, args.hosts)
        except ValueError as error:
            getattr(parser, "subcommands", {}).get(args.command, parser).error(f"argument --np: {error}")


def _check_config(parser, args):
    """A --config file is read and validated here, before anything is launched: a usage error names it."""
    if not getattr(args, "config", None):
        return
    from keras_boost.config import read_config
    from keras_boost.mindspore.auto_boost import AutoBoost

    try:
        config = read_config(args.config)
        for level in getattr(args, "levels", None) or [getattr(args, "level", "O0")]:
            AutoBoost(level.partition(":")[0], config)
    except OSError as error:
        problem = f"cannot read {args.config!r}: {error.strerror or error}"
    except (ValueError, TypeError) as error:
        problem = f"{args.config!r}: {error}"
    else:
        return
    getattr(parser, "subcommands", {}).get(args.command, parser).error(f"argument --config: {problem}")


def _launch_target(args):
    return {"hosts": args.hosts, "network_interface": args.network_interface, "start_timeout": args.start_timeout}


def _relaunch(args, argv):
    """Runs this same command on `--np` workers under horovodrun (on `--hosts`, or this machine)."""
    cmd = horovodrun_command(args.np, args.controller, ["-m", "keras_boost.app.cli",
                                                        *without_options(argv, LAUNCH_OPTIONS)],
                             **_launch_target(args))
    if cmd is None:
        print("keras-boost: --np > 1 needs horovodrun (run ./scripts/setup.sh)", file=sys.stderr)
        return 2
    print("launching: " + " ".join(cmd), flush=True)
    return launch.run_launcher(cmd, relaunch=" ".join(["keras-boost", *map(shlex.quote, argv)]))


def _train(args, argv):
    from keras_boost import distributed

    if (args.np > 1 or args.hosts) and not distributed.launched():
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
    launch.set_launch_target(**_launch_target(args))  # every run's horovodrun (bench.child_command)
    table = bench.run_bench(args, argv)
    print(table)
    print(f"table: {args.table}\nplot: {args.plot}")
    return 0


def _add_training_options(parser, epochs):
    from keras_boost.app.training import DATASETS, MODELS
    from keras_boost.step import registry

    parser.add_argument("--model", default="demo", choices=MODELS, help="demo (residual CNN), a keras.applications "
                        "family (trained from scratch on 32x32x3 copies of the images) or a keras-io example "
                        "with its own recipe: mnist_convnet, timeseries, xception, transformer "
                        "(keras_boost/app/recipes.py)")
    parser.add_argument("--dataset", default="fashion_mnist", choices=DATASETS,
                        help="fashion_mnist (Debian package dataset-fashion-mnist) or synthetic")
    parser.add_argument("--epochs", type=positive_int_arg, default=epochs)
    parser.add_argument("--batch-size", type=positive_int_arg, default=None, help="per-worker batch size (default: "
                        "the model's recipe: 64 for demo and the keras.applications families)")
    parser.add_argument("--lr", type=positive_float, default=None, help="learning rate of the recipe's optimizer "
                        "(default: the recipe's; demo and keras.applications: SGD 0.05, momentum 0.9)")
    parser.add_argument("--steps-per-epoch", type=positive_int_arg, default=None, help="limit batches per epoch")
    parser.add_argument("--train-samples", type=positive_int_arg, default=None, help="use the first N training samples")
    parser.add_argument("--test-samples", type=positive_int_arg, default=None, help="test on the first N test samples "
                        "(default all)")
    parser.add_argument("--config", default=None, help="boost configuration JSON file (AutoBoost sections and keys)")
    parser.add_argument("--precision", choices=["auto", "float32", "mixed_float16", "mixed_bfloat16"], default="auto",
                        help="auto (default): float32 at O0; at O1/O2 on GPUs mixed_bfloat16 (compute "
                        "capability >= 8.0) or mixed_float16 with dynamic loss scaling (7.x), on CPUs "
                        "mixed_bfloat16 with AVX512-BF16/AMX and oneDNN on, float32 otherwise; see docs/getting-started.md")
    parser.add_argument("--np", type=positive_int_arg, default=None, help="workers (default 1, or the sum of the "
                        "slots of --hosts/--hostfile); > 1 launches horovodrun itself")
    parser.add_argument("--controller", choices=["gloo", "mpi"], default="gloo", help="Horovod controller for --np "
                        "(mpi: horovodrun --mpi, i.e. Open MPI's mpirun)")
    _add_host_options(parser)
    parser.add_argument("--start-timeout", type=positive_int_arg, default=None, metavar="SECONDS",
                        help=f"horovodrun's --start-timeout: time for its ssh and network checks (default "
                        f"{launch.HOSTS_START_TIMEOUT} with hosts, unless HOROVOD_START_TIMEOUT is set)")
    parser.add_argument("--seed", type=int, default=0)
    comm = parser.add_argument_group("communication (docs/communication.md)")
    for cls in registry.stage_classes():  # each feature's own flags
        cls.add_cli_arguments({"training": parser, "communication": comm})
    comm.add_argument("--fusion-threshold-mb", type=_non_negative_float, default=None,
                      help="Horovod's tensor fusion buffer (HOROVOD_FUSION_THRESHOLD; default 128 MiB)")
    comm.add_argument("--cycle-time-ms", type=_non_negative_float, default=None,
                      help="Horovod's cycle time (HOROVOD_CYCLE_TIME; default 1 ms)")
    comm.add_argument("--autotune", action="store_true", default=None, help="Horovod's autotuning of the two above")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-boost",
        description="Boosted Keras training on Horovod. Start with `keras-boost info`, then "
        "`keras-boost train --np 2 --level O1` to train the demo model on Fashion-MNIST on 2 workers, "
        "and `keras-boost bench` to compare the levels O0/O1/O2 side by side.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, Horovod build features, AdaSum backend, world size; with "
                          "--hosts: a preflight check of every host before a multi-host launch")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    _add_host_options(info, launching=False)
    info.add_argument("--timeout", type=positive_float, default=preflight.DEFAULT_TIMEOUT, metavar="SECONDS",
                      help=f"with --hosts: seconds one host's check may take (default {preflight.DEFAULT_TIMEOUT:g}; "
                      f"ssh connects in {preflight.CONNECT_TIMEOUT} s at most)")

    train = sub.add_parser("train", help="train a model on a dataset at a boost level")
    _add_training_options(train, epochs=2)
    train.add_argument("--level", choices=["O0", "O1", "O2"], default="O0", help="boost level (default O0)")
    train.add_argument("--checkpoint-dir", default=None, help="save weights there every epoch (rank 0); a later run "
                       "starts from them when present (a warm start: its epochs run again, the optimizer starts anew)")
    train.add_argument("--backup-dir", default=None, help="back the whole training state up there at every epoch's "
                       "end (keras_boost.callbacks.BackupAndRestore); a run cut short (scancel, a requeue, a lost "
                       "host) and started again with the same folder resumes exactly where the last backup left it")
    train.add_argument("--json", action="store_true", help="print the result as one JSON object")

    bench = sub.add_parser("bench", help="train at several levels side by side; write a Markdown table and a PNG")
    _add_training_options(bench, epochs=3)
    bench.add_argument("--levels", nargs="+", type=_level_spec, default=["O0", "O1", "O2"], metavar="LEVEL[:PRECISION]",
                       help="levels to compare, the first the reference (default O0 O1 O2); a precision after a "
                       "colon runs that level in it, e.g. O1:float32 beside O1 (--precision's choice)")
    bench.add_argument("--table", default="bench.md", help="Markdown table output (default bench.md)")
    bench.add_argument("--plot", default="bench.png", help="PNG plot of test accuracy against wall time")
    bench.add_argument("--rounds", type=positive_int_arg, default=1, help="repeat every level this many times, "
                       "the levels taking turns (each run is its own process)")
    bench.add_argument("--seeds", type=int, nargs="+", default=None, help="run every level with each of these "
                       "seeds (default: --seed)")
    bench.add_argument("--run-timeout", type=positive_float, default=3600, help="seconds one run may take")
    bench.add_argument("--raw", default=None, help="also write every run (epoch and step times, test accuracy "
                       "per epoch, boost report) to this file, one JSON object per line")
    bench.add_argument("--result-json", default=None, help=argparse.SUPPRESS)
    sub.add_parser("build-horovod", add_help=False,
                   help="build Horovod (patched for TensorFlow 2.19+) for this environment's TensorFlow, "
                   "install it and report; keras-boost build-horovod --help for its options")
    parser.subcommands = {"info": info, "train": train, "bench": bench}  # their own usage in errors
    return parser


def main(argv=None):
    import warnings

    # Keras under numpy 2 (TensorFlow 2.20+) warns on every conversion of a tensor; the command's
    # own module would be named as its source, so Python would show it (twice per worker)
    warnings.filterwarnings("ignore", message=r"__array__ implementation doesn't accept a copy keyword",
                            category=DeprecationWarning)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["build-horovod"]:
        from keras_boost.app import horovod_build

        return horovod_build.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _hosts_from_slurm(args)
    _resolve_hosts(parser, args)
    _check_config(parser, args)
    if args.command in ("train", "bench") and args.batch_size is None:
        from keras_boost.app.recipes import recipe

        args.batch_size = recipe(args.model).batch_size
    commands = {"info": lambda: _info(args), "train": lambda: _train(args, argv), "bench": lambda: _bench(args, argv)}
    return commands[args.command]()


if __name__ == "__main__":
    sys.exit(main())
