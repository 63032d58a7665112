"""Data-parallel averaging: the default `reduce` of the boost step.

Every worker ends each update with the mean of all workers' gradients, as Horovod's
`DistributedGradientTape` gives. Without split points each gradient is handed to Horovod
as soon as the backward pass produces it (Horovod's tensor fusion packs the ones that are
ready in the same cycle), so the first gradients travel while the rest are computed.
`gradient_split_groups` (MindSpore's option) makes one grouped allreduce per group of
variable indices instead; each waits for all of its gradients.

The registry makes this stage when no other stage owns `reduce` (AdaSum and the
hierarchical allreduce do); in a single process it returns the gradients unchanged.
"""

import numpy as np

from keras_boost import _validation, distributed
from keras_boost.core.contract import Stage


class Average(Stage):
    """The mean of the workers' gradients (the step's default `reduce`).

    Args:
        split_points: None, or strictly increasing variable indices at which a new
            grouped allreduce starts (`compile(gradient_split_groups=...)`).
    """

    option = "gradient_split_groups"
    default_for = "reduce"

    def __init__(self, split_points=None):
        self.split_points = _validation.check_split_points(split_points)

    @classmethod
    def from_option(cls, value, model):
        return cls(value)

    @classmethod
    def from_level(cls, boost_config, validate=False):
        """The configuration's `common.gradient_split_groups` (None: each gradient on its own)."""
        points = boost_config.params["common"]["gradient_split_groups"]
        if validate:
            _validation.check_split_points(points)
        return points

    def get_config(self):
        return {"split_points": self.split_points or None}

    def reduce(self, grads, indices):
        if distributed.size() == 1:
            return grads
        if not self.split_points:  # each gradient to Horovod as soon as it exists; Horovod fuses them
            return distributed.allreduce_each(grads)
        buckets = {}
        for position, index in enumerate(indices):
            buckets.setdefault(int(np.searchsorted(self.split_points, index, side="right")), []).append(position)
        reduced = [None] * len(grads)
        for positions in buckets.values():
            for position, g in zip(positions, distributed.grouped_allreduce([grads[p] for p in positions])):
                reduced[position] = g
        return reduced
