"""MindSpore's documented boost config at O0/O1/O2 on every worker, and a standalone cell.

Reports per rank: the compile error of an explicit AdaSum whose device_number (8) does
not fit 2 workers, the number of "AdaSum is off" warnings, and per level (and for the
standalone BoostTrainOneStep) the last loss, whether the weights changed and a hash of
the weights, which must agree across workers.
"""

import hashlib
import warnings

from common import report

import keras
import numpy as np

import keras_boost as kb
from keras_boost import distributed
from tests.test_mindspore_api import classifier, data, momentum
from tests.test_mindspore_port import LOSS, MINDSPORE_CONFIG


def checksum(model):
    return hashlib.sha256(b"".join(np.asarray(w).tobytes() for w in model.get_weights())).hexdigest()


def run():
    """Compiles before Horovod is initialised: must be the first thing of its process."""
    found = {}
    explicit = {"boost": {"mode": "manual", "adasum": True}, "common": {"device_number": 8}}
    seed_model = classifier()
    model = kb.BoostModel(seed_model.inputs, seed_model.outputs, boost_level="O0", boost_config=explicit)
    try:
        model.compile(optimizer=momentum(), loss=LOSS)  # before Horovod is initialised: read from the launcher
        found["explicit_error"] = ""
    except ValueError as error:
        found["explicit_error"] = str(error)
    rank, size = distributed.rank(), distributed.size()
    x, y = data(64)
    xs, ys = x[rank::size], y[rank::size]
    off = 0
    for level in ("O0", "O1", "O2"):
        base = classifier(seed=rank + 3)  # the workers start apart; fit broadcasts rank 0's weights
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = kb.BoostModel(base.inputs, base.outputs, boost_level=level, boost_config=MINDSPORE_CONFIG)
            model.compile(optimizer=momentum(), loss=LOSS)
            start = [np.array(w) for w in model.get_weights()]
            history = model.fit(xs, ys, batch_size=8, epochs=1, shuffle=False, verbose=0)
        off += sum(str(w.message).startswith("AdaSum is off: device_number (8)") for w in caught)
        changed = any(np.abs(a - np.asarray(b)).max() > 1e-5 for a, b in zip(start, model.get_weights()))
        found[level] = {"loss": history.history["loss"][-1], "changed": bool(changed), "checksum": checksum(model)}
    found["adasum_off_warnings"] = off

    network = classifier(seed=rank + 11)
    step = kb.BoostTrainOneStep(network, momentum(), loss_fn=LOSS)
    losses = [float(step(xs[i:i + 8], ys[i:i + 8])) for i in range(0, 32, 8)]
    found["cell"] = {"loss": losses[-1], "checksum": checksum(network)}
    return found


def main():
    values = run()
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
