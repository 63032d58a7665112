"""Shared by the worker scripts that tests launch under horovodrun."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

RESULT_PREFIX = "KB_RESULT "


def report(rank, **values):
    """Records this rank's result for `tests.launch.results` (a file per rank, and a line)."""
    line = json.dumps({"rank": rank, **values})
    directory = os.environ.get("KB_RESULT_DIR")
    if directory:
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as handle:
            handle.write(line)
    print(RESULT_PREFIX + line, flush=True)
