"""The method every benchmark shares: one process per run, configurations taking turns, medians.

A machine's speed drifts (other load, CPU clocks, caches), and a process carries state from
one run to the next (TensorFlow's graphs, thread pools, allocator). So keras_boost measures
a configuration against another only like this:

- every run is its own process (`run_once`): a fresh TensorFlow, nothing shared;
- the configurations take turns, round after round, and the order rotates by one from a
  round to the next (`turn_order`), so that none is always first (with a fixed order the
  configuration run first was measured slower than the same code run later);
- each figure is the median over the rounds, with the range beside it (`median`,
  `spread`, `median_range`).

A run reports by printing one line `RESULT <json>` (rank 0's, under horovodrun, whose
prefix `[0]<stdout>:` is allowed) or by writing a file the caller reads. Used by
`keras-boost bench` (keras_boost/app/bench.py) and the scripts under scripts/.
"""

import json
import statistics
import subprocess

MARKER = "RESULT "


class RunFailed(RuntimeError):
    """A run ended with a non-zero status or without its result; the message holds its command and output tail."""


def turn_order(names, round_index, rotate=True):
    """The configurations in the order of round `round_index`: rotated by one per round when `rotate`."""
    names = list(names)
    if not names or not rotate:
        return names
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def result_line(stdout, marker=MARKER):
    """The JSON object a run printed after `marker` (the first such line), or None."""
    for line in stdout.splitlines():
        if marker in line:
            return json.loads(line[line.index(marker) + len(marker):])
    return None


def run_once(command, *, timeout, env=None, cwd=None, read=None, name=None):
    """Runs `command` in its own process and returns its result.

    Args:
        command: the argument list.
        timeout: seconds; a run that takes longer is killed (`subprocess.TimeoutExpired`).
        env, cwd: as `subprocess.run`'s.
        read: `read(done)` -> the result, from the finished process (`CompletedProcess`
            with `stdout`/`stderr` text); default: the `RESULT <json>` line of its stdout.
        name: what to call the run in an error.

    Raises:
        RunFailed: the run exited with a non-zero status or gave no result.
    """
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    result = None
    if done.returncode == 0:
        result = read(done) if read is not None else result_line(done.stdout)
    if done.returncode != 0 or result is None:
        what = name or " ".join(map(str, command))
        reason = f"exit status {done.returncode}" if done.returncode else "no result"
        raise RunFailed(f"{what} failed ({reason}): {' '.join(map(str, command))}\n"
                        f"{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
    return result


def take_turns(names, rounds, command, *, timeout, env=None, cwd=None, read=None, rotate=True, report=None):
    """Runs every configuration once per round, each in its own process, taking turns.

    Args:
        names: the configurations (hashable), in the order of the first round.
        rounds: how many rounds (>= 1).
        command: `command(name, round_index)` -> the argument list of that run.
        timeout, env, cwd, read: as `run_once` (`read(done)` reads a run's result).
        rotate: rotate the order by one per round (`turn_order`).
        report: `report(name, round_index, result)`, called after each run (progress lines).

    Returns:
        {name: [result of round 0, round 1, ...]}.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    results = {name: [] for name in names}
    for round_index in range(rounds):
        for name in turn_order(names, round_index, rotate):
            result = run_once(command(name, round_index), timeout=timeout, env=env, cwd=cwd, read=read,
                              name=f"{name} (round {round_index + 1})")
            results[name].append(result)
            if report is not None:
                report(name, round_index, result)
    return results


def median(values):
    """The median of the values that are not None; None when there is none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values, digits=1):
    """"min-max" of the values that are not None (one value alone; "-" when none)."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"


def median_range(values, digits=1):
    """"median [min-max]" (the median alone for one value)."""
    m = statistics.median(values)
    if len(values) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"
