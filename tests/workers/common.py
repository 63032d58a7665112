"""Shared by the worker scripts that tests launch under horovodrun."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

RESULT_PREFIX = "KB_RESULT "


def report(rank, **values):
    """Prints one result line that `tests.launch.results` parses (one per rank)."""
    print(RESULT_PREFIX + json.dumps({"rank": rank, **values}), flush=True)
