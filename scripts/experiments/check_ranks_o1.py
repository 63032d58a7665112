"""Two workers at O1 on shards of unequal size: the ranks' weights (moving statistics included) must be equal.

Run under horovodrun, e.g. across two namespace hosts, launched from the first:

    ./scripts/cluster.sh up 2
    ./scripts/cluster.sh run kbh1 -- env TF_ENABLE_ONEDNN_OPTS=1 /work/main/.venv/bin/horovodrun --gloo -np 2 \
        -H kbh1:1,kbh2:1 /work/main/.venv/bin/python /work/main/scripts/experiments/check_ranks_o1.py

The demo ResNet at O1, SGD with momentum, 2 epochs on 600 samples (rank 0) and 424 (rank 1).
Each rank prints its host, how many BatchNorms the step fused, its loss history and a digest
of all its weights: the digests must be the same on every rank.
"""

import hashlib
import socket

import keras
import numpy as np

import keras_boost
from keras_boost import distributed
from keras_boost.app.demo_net import demo_resnet


def main():
    distributed.init()
    rank = distributed.rank()
    rng = np.random.default_rng(rank)
    x = rng.random((600 if rank == 0 else 424, 28, 28, 1), dtype=np.float32)
    y = (x[:, :14].mean(axis=(1, 2, 3)) > x[:, 14:].mean(axis=(1, 2, 3))).astype("int64")
    keras.utils.set_random_seed(0)
    base = demo_resnet(model_class=keras.Model)
    model = keras_boost.BoostModel(base.inputs, base.outputs, boost_level="O1")
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    digest = hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.weights)).hexdigest()[:16]
    fused = model.boost_step.stage("fused_batchnorm")
    print(f"RANK {rank} host {socket.gethostname()} fused {len(fused.layers)} not {fused.not_fused} "
          f"loss {[round(v, 4) for v in history.history['loss']]} weights {digest}", flush=True)


if __name__ == "__main__":
    main()
