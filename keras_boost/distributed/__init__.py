"""The only door to Horovod: rank, size, collectives and what this build supports.

Split by concern: `runtime` (launch, `init`, rank and size, stall timeout, communication
settings), `gpu` (one GPU per worker), `collectives` (averages, gathers, broadcasts,
process sets, the collective counter) and `capabilities` (what the build and launch
support). This package re-exports their public names; the rest of keras_boost calls
`distributed.<name>` and never imports Horovod itself.

Without a launcher (no `horovodrun`/`mpirun` in the environment) keras_boost runs as a
single process: `size()` is 1, collectives return their input and Horovod is never
imported, so a plain `python train.py` costs nothing extra and works even where Horovod
is not installed. Under a launcher, `init()` initialises `horovod.tensorflow`; the broken
Keras bindings (`horovod.tensorflow.keras`, `horovod.keras`) are never used.

Collectives are named by their position since the start of the trace being built, in
the thread that builds it (Horovod pairs the workers' tensors by name), so the names do
not depend on how often a worker traced, nor on what other threads trace meanwhile: a
worker that joins an elastic job traces once more than the others, and the steps of a
stage's branches are traced in the background. Eager collectives are numbered apart
(`keras_boost.eager.*`), from the last restart, which elastic training makes when the
workers re-form (`restart_collective_names`).

When counting is switched on (`count_collectives(True)`, or the environment variable
`KERAS_BOOST_COUNT_COLLECTIVES=1` before the first step is traced), every collective a
compiled step runs also increments `allreduce_count()`; tests read it to check how often a
step communicates. Off by default: the production step carries no counter.

On a GPU machine `init()` gives every worker its own GPU before TensorFlow allocates
anything: worker `local_rank` sees only GPU `local_rank` of its host, with memory growth on
(`gpu_for_worker` is the choice, `pin_gpu` applies it). `init(comm=...)` runs Horovod on
an mpi4py communicator (or a list of world ranks), for keras_boost inside a larger MPI
program.

`init(fusion_threshold_mb=..., cycle_time_ms=..., autotune=...)` sets Horovod's tensor
fusion, cycle time and autotuning before `hvd.init()` reads them; `communication()` says
which values are in force (docs/communication.md). Horovod's dynamic process sets, which
the stages that group workers need (`Stage.uses_process_sets`) and which slow every step,
are on only when such a stage was compiled before Horovod started or `init(process_sets=True)`
asks (`want_process_sets`, `dynamic_process_sets`).
"""

from keras_boost.distributed.runtime import (DEFAULT_STALL_TIMEOUT, HOROVOD_CYCLE_TIME_DEFAULT_MS,  # noqa: F401
                                             HOROVOD_FUSION_THRESHOLD_DEFAULT, STALL_TIMEOUT_ENV, _hvd,
                                             _stall_timeout_value, _state, boost_step_scope, communication,
                                             communication_env, cross_rank, cross_size, dynamic_process_sets, horovod,
                                             horovod_version, elastic_launch,
                                             in_boost_step, init,
                                             is_distributed, is_homogeneous, launch_size, launched, local_rank,
                                             local_size, rank, size, stall_check_seconds, stall_timeout,
                                             want_process_sets)
from keras_boost.distributed.gpu import gpu_for_worker, gpus, pin_gpu, pinned  # noqa: F401
from keras_boost.distributed.collectives import (CollectiveMismatch, allreduce_op,  # noqa: F401
                                                 add_process_set, allgather, allgather_object, allreduce,
                                                 allreduce_count, allreduce_each, barrier, broadcast_object,
                                                 broadcast_variables, count_collectives, counting,
                                                 grouped_allreduce, reducescatter, rendezvous,
                                                 restart_collective_names, start_trace)
from keras_boost.distributed.capabilities import capabilities, launch_facts  # noqa: F401
