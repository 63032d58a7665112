"""Data-parallel averaging: the default `reduce` of the boost step.

Every worker ends each update with the mean of all workers' gradients, as Horovod's
`DistributedGradientTape` gives. By default all gradients of an update go in one grouped
allreduce (one negotiation, one fused buffer), which starts when the backward pass has
produced them all. `gradient_split_groups` (MindSpore's option) makes one grouped
allreduce per group of variable indices; `gradient_split_groups="each"` hands each
gradient to Horovod as soon as the backward pass produces it, as Horovod's tape does
(Horovod's tensor fusion packs the ones ready in the same cycle), so the first gradients
travel while the rest are computed. Which pays depends on the link and the model
(docs/communication.md has the measurements).

The registry makes this stage when no other stage owns `reduce` (AdaSum and the
hierarchical allreduce do); in a single process it returns the gradients unchanged.
"""

import numpy as np

from keras_boost import _validation, distributed
from keras_boost.core.contract import Stage


class Average(Stage):
    """The mean of the workers' gradients (the step's default `reduce`).

    Args:
        split_points: None (one grouped allreduce), strictly increasing variable indices
            at which a new grouped allreduce starts, or "each" (one allreduce per gradient,
            as soon as it exists) (`compile(gradient_split_groups=...)`).
    """

    option = "gradient_split_groups"
    option_help = ('None (one grouped allreduce per update), "each" (one allreduce per gradient, sent as soon as it '
                   'exists) or increasing indices into `trainable_variables` at which to start a new fused allreduce'
                   " (MindSpore's `gradient_split_groups`).")
    default_for = "reduce"
    carries_votes = True  # a scalar added to the list is averaged in the gradients' collective (step/loop.py)

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
        if self.split_points == "each":  # each gradient to Horovod as soon as it exists; Horovod fuses them
            return distributed.allreduce_each(grads)
        buckets = {}
        for position, index in enumerate(indices):
            buckets.setdefault(int(np.searchsorted(self.split_points, index, side="right")), []).append(position)
        reduced = [None] * len(grads)
        for positions in buckets.values():
            for position, g in zip(positions, distributed.grouped_allreduce([grads[p] for p in positions])):
                reduced[position] = g
        return reduced
