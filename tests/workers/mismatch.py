"""Workers started with different models, boost options or batch sizes: fit must refuse at once.

Rank 1 differs from rank 0 in one thing per case; each case must raise the same ValueError
on every worker before any other collective, so the job goes on to the next case and ends
with a correct fit (which would hang or fail if a collective had been left pending).
"""

import hashlib
import time

from common import report

from keras_boost import BoostModel, distributed
from tests.helpers import classification_data, compile_sgd, mlp, weights


def run():
    distributed.init()
    rank = distributed.rank()
    x, y = classification_data(n=64)
    other = rank == 1
    cases = {
        "model": dict(model=dict(hidden=32 if other else 16), boost={}, batch_size=16),
        "boost": dict(model={}, boost=dict(gradient_accumulation=2) if other else {}, batch_size=16),
        "batch_size": dict(model={}, boost={}, batch_size=8 if other else 16),
    }
    messages, seconds = {}, {}
    for name, case in cases.items():
        model = compile_sgd(mlp(BoostModel, **case["model"]), **case["boost"])
        start = time.monotonic()
        try:
            model.fit(x, y, batch_size=case["batch_size"], epochs=1, verbose=0)
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
        seconds[name] = time.monotonic() - start
    model = compile_sgd(mlp(BoostModel))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in weights(model))).hexdigest()
    return dict(messages=messages, seconds=seconds, digest=digest)


def main():
    values = run()
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
