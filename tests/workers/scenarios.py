"""Runs several worker scenarios, one after the other, in one Horovod launch.

Starting Horovod costs more than most scenarios (horovodrun and every worker import
TensorFlow: 10-35 s on 2 shared cores), so the tests that need the same launch (the same
controller and number of workers) share one (`tests.launch.shared`).

Usage: scenarios.py JSON, where JSON is a list of [name, module, args]: for each entry,
`tests/workers/<module>.py`'s `run(*args)` runs on every rank and returns that rank's
values. After every scenario each rank rewrites its result file with all the values so
far, so a scenario that fails or hangs leaves the results of the ones before it. A
scenario that raises is recorded as {"error": traceback} and the next one runs.
Each scenario's values get "scenario_seconds", its wall time on that rank.

Scenarios must make the same collective calls in the same order on every rank, and must
not depend on being first in the process; a scenario that must run before Horovod is
initialised (mindspore_config) is listed first.
"""

import importlib
import json
import sys
import time
import traceback

from common import write_result

from keras_boost import distributed


# the scenarios whose stages register Horovod process sets (distributed.init(process_sets=...))
NEEDS_PROCESS_SETS = {"adasum_training", "hierarchical"}


def main():
    found = {}
    scenarios = json.loads(sys.argv[1])
    # Horovod starts once for all of them (in the first scenario that needs it, mindspore_config
    # must come before): with dynamic process sets when one of them needs them
    if any(module in NEEDS_PROCESS_SETS for _, module, _ in scenarios):
        distributed.want_process_sets("the scenarios " + ", ".join(sorted(NEEDS_PROCESS_SETS)))
    for name, module, args in scenarios:
        print(f"scenarios: {name} starts at {time.time():.2f}", flush=True)
        start = time.monotonic()
        try:
            values = importlib.import_module(module).run(*args)
        except Exception:  # noqa: BLE001 - recorded for the test that reads this scenario
            values = {"error": traceback.format_exc()}
            print(f"scenarios: {name} failed:\n{values['error']}", flush=True)
        values["scenario_seconds"] = round(time.monotonic() - start, 2)
        found[name] = values
        rank = distributed.rank()
        write_result(rank, found)
        print(f"scenarios: {name} ends on rank {rank} after {values['scenario_seconds']} s", flush=True)


if __name__ == "__main__":
    main()
