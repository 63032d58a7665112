"""What the weights' moving average (`compile(ema=...)`, on at O2) costs per update, timed alone.

Builds the stage on keras.applications ResNet50's trainable weights (32x32x3 input, 10
classes: 23.5M weights) and times its `after_update` (the average's update, in a
tf.function as in the step), 20 calls per round, 3 rounds.

    .venv/bin/python scripts/experiments/bench_ema_cost.py
"""

import time

import keras
import tensorflow as tf

from keras_boost.core.contract import StepContext
from keras_boost.core.state import BoostState
from keras_boost.stages.ema import ExponentialMovingAverage


def main():
    model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    stage = ExponentialMovingAverage()
    stage.build(StepContext(model=model, optimizer=None, variables=model.trainable_variables, state=BoostState()))
    update = tf.function(stage.after_update)
    update()
    weights = sum(int(tf.size(v)) for v in model.trainable_variables)
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(20):
            update()
        print(f"{weights / 1e6:.1f}M weights: {(time.perf_counter() - start) / 20 * 1000:.1f} ms per update")


if __name__ == "__main__":
    main()
