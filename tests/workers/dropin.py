"""Issue 14 on 2 workers: custom train_step, jit_compile=True, rank-0-only evaluate/predict/save.

    dropin.py custom_step   a BoostModel subclass with the usual Keras train_step (tape,
                            self.optimizer.apply_gradients), each rank on its shard
    dropin.py jit           compile(jit_compile=True), boost options on
    dropin.py rank0 DIR     fit; evaluate on all ranks; then `if rank == 0: evaluate/predict/save`
                            at the end of the script
    dropin.py files DIR     a script written for one machine: Keras' file-writing callbacks with the
                            same paths on every worker, then both workers saving one path at once
    dropin.py same_data     fit on the same arrays on every worker, then on each worker's part
"""

import sys
import warnings

from common import report  # noqa: E402  (puts the repository on sys.path)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_boost import BoostModel, distributed  # noqa: E402

BATCH = 16
STEPS = 6


def data(n_per_rank=BATCH * STEPS, seed=1):
    """Both ranks' shards (rank r uses rows r*n .. (r+1)*n)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2 * n_per_rank, 8)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(8, 4)), axis=1).astype(np.int32)
    return x, y


def mlp(model_class, seed=0):
    keras.utils.set_random_seed(seed)
    x_in = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", name="hidden")(x_in)
    return model_class(x_in, keras.layers.Dense(4, name="logits")(h))


class CustomStep(BoostModel):
    """The usual Keras 3 custom train_step, unchanged."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        return {m.name: m.result() for m in self.metrics}


def compile_sgd(model, **kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def flat(model):
    return [np.asarray(w).ravel().tolist() for w in model.get_weights()]


def local_loss(model, x, y):
    return float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x)))


def run(mode, directory=None):
    """One mode (see the module docstring); returns this rank's values."""
    distributed.init()
    rank, size = distributed.rank(), distributed.size()
    x, y = data()
    n = len(x) // size
    xs, ys = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]

    if mode == "custom_step":
        model = compile_sgd(mlp(CustomStep, seed=rank))  # different starts: the broadcast must fix them
        history = model.fit(xs, ys, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
        return dict(weights=flat(model), loss=history.history["loss"])

    if mode == "jit":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = compile_sgd(mlp(BoostModel, seed=rank), jit_compile=True, loss_scale="dynamic",
                                gradient_accumulation=2, metrics=["accuracy"])
            model.fit(xs, ys, batch_size=BATCH, epochs=2, verbose=0, shuffle=False)
            loss = model.evaluate(xs, ys, batch_size=BATCH, verbose=0, return_dict=True, across_workers=True)["loss"]
        jit_warnings = [str(w.message) for w in caught if "jit_compile" in str(w.message)]
        return dict(weights=flat(model), jit_warnings=jit_warnings, loss=loss, jit_compile=bool(model.jit_compile))

    if mode == "rank0":
        model = compile_sgd(mlp(BoostModel), loss_scale="dynamic", metrics=["accuracy"])
        model.fit(xs, ys, batch_size=BATCH, epochs=1, verbose=0)
        values = {"all_evaluate": model.evaluate(xs, ys, batch_size=BATCH, verbose=0, return_dict=True,
                                                 across_workers=True)["loss"],
                  "all_local_loss": local_loss(model, xs, ys)}
        if rank == 0:  # the Horovod idiom, at the end of the script: the other ranks go on meanwhile
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                values["rank0_evaluate"] = model.evaluate(xs, ys, batch_size=BATCH, verbose=0,
                                                          return_dict=True)["loss"]
            values["rank0_warnings"] = [str(w.message) for w in caught]
            values["rank0_local_loss"] = local_loss(model, xs, ys)
            values["rank0_predict"] = model.predict(xs[:4], verbose=0).tolist()
            model.save(f"{directory}/model.keras")
            model.save_weights(f"{directory}/model.weights.h5")
            try:  # every worker's metrics, asked on rank 0 alone once the others have exited: cannot mean anything
                model.evaluate(xs, ys, batch_size=BATCH, verbose=0, across_workers=True)
            except RuntimeError as error:
                values["rank0_across_error"] = str(error)
        return dict(weights=flat(model), **values)

    if mode == "files":  # a script written for one machine: every worker writes the same paths
        import os

        os.makedirs(directory, exist_ok=True)
        model = compile_sgd(mlp(BoostModel), metrics=["accuracy"])
        callbacks = [keras.callbacks.CSVLogger(f"{directory}/log.csv", append=True),
                     keras.callbacks.CSVLogger(f"{directory}/log{rank}.csv"),  # a path of its own: kept
                     keras.callbacks.TensorBoard(f"{directory}/tb"),
                     keras.callbacks.ModelCheckpoint(f"{directory}/e{{epoch}}.weights.h5", save_weights_only=True),
                     keras.callbacks.ModelCheckpoint(f"{directory}/best.keras", save_best_only=True, monitor="loss"),
                     keras.callbacks.BackupAndRestore(f"{directory}/backup", delete_checkpoint=False)]
        model.fit(xs, ys, batch_size=BATCH, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
        errors = []
        for _ in range(12):  # both workers save one path at the same moment, again and again
            distributed.barrier()
            try:
                model.save_weights(f"{directory}/same.weights.h5")
                model.save(f"{directory}/same.keras")
            except Exception as error:  # noqa: BLE001 - reported
                errors.append(f"{type(error).__name__}: {error}"[:300])
        distributed.barrier()
        return dict(weights=flat(model), errors=errors)

    if mode == "same_data":  # every worker given the whole arrays, then each its part
        import contextlib
        import io

        lines = {}
        for name, (xw, yw), split in (("whole", (x, y), 0.0), ("whole_split", (x, y), 0.25),
                                      ("shards", (xs, ys), 0.0)):
            model = compile_sgd(mlp(BoostModel))
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                model.fit(xw, yw, batch_size=BATCH, epochs=1, verbose=0, validation_split=split)
            lines[name] = [line for line in printed.getvalue().splitlines() if "were given the same" in line]
        return lines

    raise ValueError(f"unknown mode {mode!r}")


def main():
    values = run(*sys.argv[1:])
    report(distributed.rank(), **values)


if __name__ == "__main__":
    main()
