"""The keras-boost command: info, train (1 and 2 workers), bench, bad arguments."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "keras_boost.app.cli"]


def expected_frozen_share(updates, **freeze):
    """The share of frozen steps of O1's schedule (`freeze`: the config's grad_freeze) sized to `updates`."""
    from keras_boost import GradientFreeze

    sequence = GradientFreeze(**{**freeze, "total_steps": updates}).generate_freeze_index_sequence()[:updates]
    return round(float(np.mean(sequence > 0)), 3)


def keras_boost(*args, timeout=300):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT),
               OMPI_MCA_mpi_yield_when_idle="1", CUDA_VISIBLE_DEVICES="")  # CPU, also on a 1-GPU machine
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_info_json():
    result = keras_boost("info", "--json")
    assert result.returncode == 0, result.stderr
    caps = json.loads(result.stdout)
    assert caps["horovod"] == "0.28.1" and caps["mpi_built"] and caps["gloo_built"] and caps["size"] == 1


def test_train_single_process_with_level_and_checkpoint(tmp_path):
    from keras_boost import MINDSPORE_DEFAULTS

    config = tmp_path / "mindspore.json"
    config.write_text(json.dumps(MINDSPORE_DEFAULTS))
    args = ["train", "--dataset", "synthetic", "--train-samples", "256", "--epochs", "1", "--batch-size", "32",
            "--steps-per-epoch", "3", "--level", "O1", "--loss-scale", "dynamic", "--json",
            "--checkpoint-dir", str(tmp_path), "--config", str(config)]
    result = keras_boost(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["workers"] == 1 and summary["level"] == "O1"
    assert summary["batchnorms_removed"] == "5 of 9" and summary["overflows"] == 0
    assert summary["fused_update"] is True  # the level's fused update, on the CLI's SGD with momentum
    # 3 updates of MindSpore's O1 schedule [0, 3, 0, ...]: one of three steps frozen
    assert summary["frozen_step_share"] == expected_frozen_share(3, **MINDSPORE_DEFAULTS["grad_freeze"]) == 0.333
    assert (tmp_path / "model.weights.h5").exists()


def test_a_short_run_reports_the_freezing_that_ran():
    """O1's own freezing in a 4-step run: held back by the gate, then switched off before a group compiled."""
    args = ["train", "--dataset", "synthetic", "--train-samples", "256", "--epochs", "1", "--batch-size", "32",
            "--steps-per-epoch", "4", "--level", "O1", "--json"]
    result = keras_boost(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "O1's gradient_freeze switched off in one process before compiling its groups" in result.stdout
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["frozen_step_share"] == 0.0  # what ran, not what the schedule says (0.333 here)


def test_train_two_workers(tmp_path):
    freeze = {"param_groups": 2, "freeze_p": 0.5}  # keras_boost's continuous strategy: [0, 1, 0, 1, ...]
    config = tmp_path / "boost.json"
    config.write_text(json.dumps({"grad_freeze": freeze}))
    args = ["train", "--np", "2", "--dataset", "synthetic", "--train-samples", "256", "--epochs", "1",
            "--batch-size", "32", "--steps-per-epoch", "2", "--level", "O1", "--json", "--config", str(config)]
    result = keras_boost(*args)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    launch = next(l for l in result.stdout.splitlines() if l.startswith("launching: "))
    assert " -np 2 " in launch and "horovodrun" in launch
    lines = [l for l in result.stdout.splitlines() if '"workers"' in l]
    assert len(lines) == 1, lines  # rank 0 alone reports
    summary = json.loads(lines[0][lines[0].index("{"):])
    assert summary["workers"] == 2 and summary["epochs"] == 1 and summary["level"] == "O1"
    assert summary["batchnorms_removed"] == "5 of 9"
    # 2 updates of the schedule [0, 1]: the second step of both workers was a frozen one
    assert summary["frozen_step_share"] == expected_frozen_share(2, **freeze) == 0.5
    assert np.isfinite(summary["train_loss"]) and 0 <= summary["test_accuracy"] <= 1


def test_bench_writes_table_and_plot(tmp_path):
    table, plot, raw = tmp_path / "bench.md", tmp_path / "bench.png", tmp_path / "runs.jsonl"
    args = ["bench", "--dataset", "synthetic", "--train-samples", "256", "--epochs", "2", "--batch-size", "32",
            "--steps-per-epoch", "2", "--levels", "O0", "O1", "O0:mixed_bfloat16", "--table", str(table),
            "--plot", str(plot), "--raw", str(raw)]
    result = keras_boost(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    text = table.read_text()
    assert "| O0 |" in text and "| O1 |" in text and "batchnorms_removed=5 of 9" in text
    assert "| O0:mixed_bfloat16 |" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = [json.loads(line) for line in raw.read_text().splitlines()]
    assert [r["level"] for r in runs] == ["O0", "O1", "O0:mixed_bfloat16"]  # the levels took turns, one line each
    assert all(len(r["accuracies"]) == 2 and len(r["epoch_times"]) == 2 and len(r["losses"]) == 2 for r in runs)
    # a level given with a precision runs in it; O0 alone stays float32 whatever the machine
    assert [r["report"]["precision"] for r in runs][::2] == ["float32", "mixed_bfloat16"]


@pytest.mark.parametrize("args, message", [
    (["train", "--epochs", "0"], "expected a positive integer"),
    (["train", "--lr", "-1"], "expected a positive number"),
    (["train", "--level", "O3"], "invalid choice"),
    (["train", "--model", "vgg"], "invalid choice"),
    (["bench", "--levels", "O5"], "a level is one of ('O0', 'O1', 'O2')"),
    (["bench", "--levels", "O1:float8"], "got 'O1:float8'"),
    (["bench", "--levels", "O1:"], "got 'O1:'"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments(args, message, capsys):
    # in this process: `python -m keras_boost.app.cli` is `sys.exit(main())`, and each command
    # process would spend its 6-7 s importing TensorFlow before argparse says no
    from keras_boost.app import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_argument_exits_2_from_the_command():
    result = keras_boost("train", "--epochs", "0", timeout=60)
    assert result.returncode == 2
    assert "expected a positive integer, got 0" in result.stderr


def test_bad_config_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"grad_freeze": {"freeze_pp": 1}}))
    result = keras_boost("train", "--dataset", "synthetic", "--config", str(path), timeout=120)
    assert result.returncode == 2 and "freeze_pp" in result.stderr
    assert "Traceback" not in result.stderr  # a usage error, not a traceback


@pytest.mark.parametrize("content, message", [
    ('{"boost": {"less_bn": "yes"}}', "`boost_config['boost']['less_bn']` must be a bool (True or False), got 'yes'"),
    ('{"boost": ', "is not valid JSON"),
    ("[1, 2]", "boost_config must be a dict"),
    (None, "cannot read"),
])
@pytest.mark.parametrize("command", [["train", "--np", "2"], ["bench", "--levels", "O0", "O1"]])
def test_a_bad_config_file_is_a_usage_error_before_anything_is_launched(tmp_path, capsys, content, message, command):
    from keras_boost.app import cli

    path = tmp_path / "c.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--config", str(path)])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert f"keras-boost {command[0]}: error: argument --config: " in captured.err and message in captured.err
    assert "launching" not in captured.out


def test_bench_summary_takes_medians_over_runs_and_the_target_from_the_first_level():
    from keras_boost.app.bench import markdown_table, summarize

    def run(level, seed, epochs, accuracies, step):
        return {"level": level, "seed": seed, "epoch_times": epochs, "accuracies": accuracies, "first_step": epochs[0] / 2,
                "step_time": step, "steps_per_epoch": 10, "report": {"level": level}}

    runs = [run("O0", 0, [10, 4, 6], [0.5, 0.806, 0.82], 0.2), run("O1", 0, [12, 3, 3], [0.5, 0.83, 0.83], 0.1),
            run("O0", 1, [10, 4, 4], [0.5, 0.6, 0.812], 0.2), run("O1", 1, [12, 2, 2], [0.5, 0.805, 0.82], 0.1)]
    target, rows = summarize(runs, ["O0", "O1"])
    assert target == pytest.approx(0.816)  # the mean final accuracy of O0's runs
    o0, o1 = rows
    assert o0["epoch"] == 4.5 and o1["epoch"] == 2.5  # medians of the per-run medians after epoch 1: [5, 4], [3, 2]
    # the mean curve: O0 reaches its own mean at its last epoch (10+4+5 s); alone, only seed 0 does (after 20 s)
    assert o0["to_target"] == pytest.approx(19) and o0["to_target_runs"] == [20, None] and o0["reached"] == 1
    # O1's mean accuracy after 2 epochs is 0.8175, after 12 + 2.5 s on average, 20 steps; alone 15 s and 16 s
    assert o1["to_target"] == pytest.approx(14.5) and o1["steps_to_target"] == 20 and o1["to_target_runs"] == [15, 16]
    assert o0["to_near_runs"] == [20, 18] and o0["near_reached"] == 2 and o1["to_near"] == pytest.approx(14.5)
    table = markdown_table(runs, ["O0", "O1"])
    assert "| O1 | 2.5 (2.0-3.0) |" in table
    assert "| 19.0 (20.0; 1 of 2 runs) | 30 | 1.00x | 19.0 (18.0-20.0) | 1.00x |" in table
    assert "| 14.5 (15.0-16.0) | 20 | 1.31x | 14.5 (15.0-16.0) | 1.31x |" in table


def test_time_to_target_is_read_from_the_mean_curve_of_the_runs():
    from keras_boost.app.bench import mean_curve_time

    first = {"epoch_times": [10, 6], "accuracies": [0.8, 0.8]}  # alone at the target after its first epoch
    second = {"epoch_times": [12, 4], "accuracies": [0.5, 0.8]}
    # the mean accuracy is 0.65, then 0.8: the curve reaches 0.75 after the second epoch, 11 + 5 s on average
    assert mean_curve_time([first, second], 0.75) == (16, 2)
    assert mean_curve_time([first, second], 0.81) == (None, None)


def test_bench_level_with_a_precision_runs_the_level_in_it():
    from keras_boost.app.bench import parse_level

    assert parse_level("O1") == ("O1", None) and parse_level("O1:float32") == ("O1", "float32")
    assert parse_level("O0:mixed_bfloat16") == ("O0", "mixed_bfloat16")
    with pytest.raises(ValueError, match="got 'O3:float32'"):
        parse_level("O3:float32")


def test_the_launcher_passes_its_output_and_status_through(capfd):
    from keras_boost.app.launch import run_launcher

    status = run_launcher([sys.executable, "-c", "import sys; print('to stdout'); print('to stderr', file=sys.stderr); "
                                                 "sys.exit(3)"])
    out, err = capfd.readouterr()
    assert status == 3 and "to stdout" in out and "to stderr" in err


def test_a_launcher_still_waiting_after_a_worker_ended_the_job_is_ended(tmp_path, capfd):
    """Open MPI's abort waits on the daemon of a host that lost its link (docs/reliability.md):
    a stand-in launcher that prints the stall watchdog's line, starts a child and waits on (60 s) is
    ended, child included, `grace` seconds after the line."""
    import time

    from keras_boost.app.launch import run_launcher

    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              f"child = subprocess.Popen(['sleep', '90']); open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "print('[1,0]<stderr>:keras_boost: stall: rank 0 of 2 has been in train step 4 for 20 s "
              "(stall_timeout=20 s); ending the job.', file=sys.stderr, flush=True)\n"
              "time.sleep(60)\n")  # a launcher left waiting ends by itself after 60 s: the test fails, no hang
    start = time.monotonic()
    status = run_launcher([sys.executable, "-c", script], grace=2)
    took = time.monotonic() - start
    out, err = capfd.readouterr()
    assert status == 75 and took < 30, (status, took)
    assert "ending the job" in err and "the launcher is still waiting" in err
    child = int(pid_file.read_text())
    for _ in range(50):  # the group got SIGTERM: the child is gone (or a zombie of the ended launcher)
        try:
            state = Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the launcher's child {child} still runs")


def test_a_failed_job_ends_with_the_lost_ranks_and_the_command_to_relaunch(capfd):
    from keras_boost.app import launch

    script = ("import sys\n"
              "print('[0]<stderr>:keras_boost: lost: rank 0 of 2 on hostA: a collective of fit was abandoned: '\n"
              "      'nothing heard from rank 1 on hostB (last heard 31 s ago)', file=sys.stderr)\n"
              "print('Traceback (most recent call last): horovodrun', file=sys.stderr)\n"
              "sys.exit(1)\n")
    status = launch.run_launcher([sys.executable, "-c", script], relaunch="keras-boost train --hosts hostA:1,hostB:1")
    assert status == 1
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines[-3:] == [
        "keras-boost: the job ended with status 1.",
        "keras_boost: lost: rank 0 of 2 on hostA: a collective of fit was abandoned: nothing heard from rank 1 on "
        "hostB (last heard 31 s ago)",
        "keras-boost: to go on, relaunch: keras-boost train --hosts hostA:1,hostB:1"]


def test_each_stages_flags_become_its_compile_option(tmp_path):
    """`keras-boost train`'s feature flags come from the stages (`add_cli_arguments`), and each stage
    turns its own into its compile option (`option_from_cli`); a config's grad_freeze section is sized
    to the run's updates, accumulation's window counted."""
    from keras_boost.app import training
    from keras_boost.app.cli import build_parser

    parser = build_parser()
    plain = parser.parse_args(["train"])
    assert training.cli_options(plain) == {}
    flags = parser.parse_args(["train", "--accumulation", "4", "--loss-scale", "dynamic", "--compression", "float16",
                               "--hierarchical-allreduce", "--swa", "0.5"])
    assert training.cli_options(flags) == {"gradient_accumulation": 4, "loss_scale": "dynamic",
                                           "compression": "float16", "hierarchical_allreduce": True, "swa": 0.5}
    assert training.needs_process_sets(flags) and not training.needs_process_sets(plain)
    config = tmp_path / "freeze.json"
    config.write_text(json.dumps({"grad_freeze": {"param_groups": 2}}))
    sized = parser.parse_args(["train", "--accumulation", "4", "--config", str(config)])
    assert training._boost_config(sized, 40)["grad_freeze"]["total_steps"] == 10  # 40 batches, 4 per update
