"""Shared by the worker scripts that tests launch under horovodrun."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

RESULT_PREFIX = "KB_RESULT "


def write_result(rank, values):
    """Writes this rank's result file for `tests.launch.results` (atomically: a reader never sees half)."""
    directory = os.environ.get("KB_RESULT_DIR")
    if directory:
        path = os.path.join(directory, f"rank{rank}.json")
        with open(path + ".tmp", "w") as handle:
            handle.write(json.dumps({"rank": rank, **values}))
        os.replace(path + ".tmp", path)


def report(rank, **values):
    """Records this rank's result for `tests.launch.results` (a file per rank, and a line)."""
    write_result(rank, values)
    print(RESULT_PREFIX + json.dumps({"rank": rank, **values}), flush=True)
