"""3 MPI ranks: ranks 0 and 1 train a BoostModel in an mpi4py sub-communicator, rank 2 does other work.

Started by plain `mpirun -np 3` (no horovodrun). The trainers report their Horovod size and
rank, a hash of their final weights and the largest difference to a single-process plain
Keras run with the 2-worker global batch; rank 2 sends a message to world rank 0 over
MPI_COMM_WORLD, which rank 0 receives after training, and never initialises Horovod.
"""

import hashlib
import sys

from common import report

from mpi4py import MPI

import keras
import numpy as np

from keras_boost import BoostModel, distributed
from tests.helpers import classification_data, compile_sgd, max_diff, mlp, weights

world = MPI.COMM_WORLD


def _abort_on_error(kind, value, traceback):  # an error on one rank ends the job instead of a hang in Barrier
    sys.__excepthook__(kind, value, traceback)
    world.Abort(1)


sys.excepthook = _abort_on_error
trainer = world.Get_rank() < 2
sub = world.Split(color=0 if trainer else 1, key=world.Get_rank())

if trainer:
    distributed.init(comm=sub)  # only the 2 trainers start Horovod
    rank, size = distributed.rank(), distributed.size()
    x, y = classification_data(n=128)
    reference = compile_sgd(mlp(keras.Model, seed=0))
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = compile_sgd(mlp(BoostModel, seed=rank + 3))  # start apart: fit broadcasts rank 0's weights
    if rank == 0:
        for variable, value in zip(model.trainable_variables, mlp(keras.Model, seed=0).get_weights()):
            variable.assign(value)
    # rank r takes rows r*16..r*16+15 of every 32-row global batch
    rows = np.concatenate([np.arange(b + rank * 16, b + rank * 16 + 16) for b in range(0, 128, 32)])
    model.fit(x[rows], y[rows], batch_size=16, epochs=2, shuffle=False, verbose=0)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()
    message = world.recv(source=2, tag=7) if world.Get_rank() == 0 else None
    report(world.Get_rank(), size=size, hvd_rank=rank, digest=digest, diff=max_diff(weights(reference), weights(model)),
           message=message, collectives=distributed.allreduce_count())
else:
    other = float(np.sum(np.arange(10.0)))  # "something else"
    world.send({"from": world.Get_rank(), "sum": other}, dest=0, tag=7)
    report(world.Get_rank(), horovod_initialised=distributed._state.initialized, sub_size=sub.Get_size())
world.Barrier()
