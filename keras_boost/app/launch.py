"""Command lines of the keras-boost command: options removed, horovodrun in front."""

import os
import shutil
import sys


def without_options(argv, names):
    """`argv` without the options in `names` (`--name value...` or `--name=value`), values included."""
    cleaned, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token in names
            if skipping or token.split("=", 1)[0] in names:
                continue
        elif skipping:
            continue
        cleaned.append(token)
    return cleaned


def horovodrun_command(np_workers, controller, arguments):
    """`horovodrun -np N -H localhost:N --<controller> python <arguments>`, or None without horovodrun."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        horovodrun = shutil.which("horovodrun")
    if horovodrun is None:
        return None
    return [horovodrun, "-np", str(np_workers), "-H", f"localhost:{np_workers}", f"--{controller}",
            sys.executable, *arguments]
