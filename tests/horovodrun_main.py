"""`horovodrun` as the tests start it: Horovod's own entry point, with its build check asked once.

At every launch `horovodrun` asks whether Horovod was built with Gloo (or MPI) in a forked
process that imports horovod.tensorflow, hence TensorFlow: 5-9 s of each launch on 2 shared
cores, for an answer that does not change during a test session. `tests.launch` asks
Horovod once per session (`horovod.tensorflow.gloo_built()` / `mpi_built()`, what that
check calls) and passes the answers in KB_HOROVOD_GLOO_BUILT / KB_HOROVOD_MPI_BUILT ("1" or
"0"); this script gives them to `horovod.runner.launch` and runs its `run_commandline()`,
exactly what the `horovodrun` script runs. Without those variables it is plain horovodrun.
"""

import os
import sys

from horovod.runner import launch


def main():
    for name, variable in (("gloo_built", "KB_HOROVOD_GLOO_BUILT"), ("mpi_built", "KB_HOROVOD_MPI_BUILT")):
        if variable in os.environ:
            answer = os.environ[variable] == "1"
            setattr(launch, name, lambda verbose=False, answer=answer: answer)
    sys.argv[0] = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return launch.run_commandline()


if __name__ == "__main__":  # the guard matters: horovodrun starts helper processes with "spawn"
    sys.exit(main())
