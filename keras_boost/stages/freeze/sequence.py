"""Gradient freezing, the sequence: which group each step trains.

An index sequence says which group each step trains: index 0 (a full step) on a `freeze_p`
share of the steps, a partial group on the rest, in MindSpore's continuous ("0000…01234…")
or interval ("0 k 0 0 k 0 …") order. Pure NumPy; `round_robin` is the sequence of a
`FreezeOpt` given no strategy.
"""

import numpy as np
import tensorflow as tf

from keras_boost._validation import check_int, check_real, check_steps

CONTINUOUS_STRATEGY = 0  # "0000…01234…": zeros, then every partial group in turn
INTERVAL_STRATEGY = 1  # "0 k 0 0 k 0 …": full steps interleaved with sampled groups


def _check_freeze_p(freeze_p):
    return check_real("freeze_p", freeze_p, low=0, low_inclusive=False, high=1,
                      allowed="a number in (0, 1] (the share of full, unfrozen steps)")


def _check_strategy(freeze_strategy, name="freeze_strategy"):
    valid = isinstance(freeze_strategy, (int, np.integer)) and not isinstance(freeze_strategy, bool)
    if not valid or freeze_strategy not in (CONTINUOUS_STRATEGY, INTERVAL_STRATEGY):
        raise ValueError(
            f"Unsupported freezing training strategy {freeze_strategy!r}: `{name}` "
            f"must be {CONTINUOUS_STRATEGY} (continuous) or {INTERVAL_STRATEGY} (interval)."
        )
    return int(freeze_strategy)


def _check_seed(seed):
    return check_int("seed", seed, 0, 2**32 - 1)


def _continuous_sequence(groups, freeze_p, length):
    # MindSpore's count of full steps, exactly; with freeze_p next to 1 it exceeds any run
    # (1e16 for p = 1 - 1e-16, which MindSpore would try to allocate): then the first
    # `length` steps are all full steps, and the pattern stops at 2**20 or `length` of them
    zeros = int(freeze_p * (groups - 1) // (1 - freeze_p) + 0.5)
    zeros = min(zeros, max(length, 2**20))
    pattern = np.concatenate([np.zeros(zeros, np.int32), np.arange(1, groups, dtype=np.int32)])
    return np.tile(pattern, -(-length // len(pattern)))


def _interval_freeze_steps(freeze_p, length):
    """Boolean mask of the partial steps: keeps the running partial share just below 1-p."""
    partial = np.zeros(length, bool)
    full_count, partial_count = 1, 0
    for step in range(1, length):
        if partial_count / (full_count + partial_count) < 1 - freeze_p:
            partial[step] = True
            partial_count += 1
        else:
            full_count += 1
    return partial


def _interval_sequence(groups, freeze_p, length, seed):
    partial = _interval_freeze_steps(freeze_p, length)
    weights = np.arange(1, groups) / sum(range(1, groups))
    sequence = np.zeros(length, np.int32)
    # Sampling from the reversed indices gives P(k) = (G - k) / (G (G - 1) / 2).
    sequence[partial] = np.random.RandomState(seed).choice(
        np.arange(groups - 1, 0, -1), size=int(partial.sum()), p=weights
    )
    return sequence


def generate_freeze_index_sequence(
    parameter_groups_number, freeze_strategy, freeze_p, total_steps, seed=0
):
    """Generates the group index to train at each step, as MindSpore does.

    Index 0 is a full step (every variable), index `k` trains group `k` only. The length
    is `T = int(total_steps * 1.01)`; the train step wraps around at the end.

    - `G <= 1` or `freeze_p == 1`: `T` zeros (MindSpore divides by zero for
      `freeze_p == 1` with the continuous strategy; here it means "never freeze").
    - Continuous (0): the pattern `[0] * z + [1, ..., G-1]`, with
      `z = int(p * (G - 1) // (1 - p) + 0.5)` (a floating-point floor division: 20 for
      p=0.7, G=10), repeated until the length is at least `T`. As in MindSpore it is not
      truncated, so the length is a whole number of patterns and wrapping around keeps
      the pattern intact.
    - Interval (1): starts with 0, then a partial step whenever the running share of
      partial steps is below `1 - p`, a full step otherwise; each partial step samples
      `k` with probability `(G - k) / (G (G - 1) / 2)`. Length exactly `T`. Sampling uses
      `np.random.RandomState(seed)`, so every worker builds the same sequence, and it
      equals MindSpore's after `np.random.seed(seed)`.

    Args:
        parameter_groups_number: int, the number of groups `G` (>= 1).
        freeze_strategy: int, 0 (continuous) or 1 (interval). Anything else raises
            `ValueError`, even when `G <= 1`.
        freeze_p: float in (0, 1], the share of full (unfrozen) steps. 0 is rejected: it
            would never train the shallow blocks.
        total_steps: int (>= 1), the planned number of training steps.
        seed: int in [0, 2**32), the seed of the interval sampling. Defaults to 0.

    Returns:
        A 1-D `np.int32` array of group indices in `[0, G)`.

    Example:

    >>> generate_freeze_index_sequence(4, 0, 0.5, 10)[:8]
    array([0, 0, 0, 1, 2, 3, 0, 0], dtype=int32)
    """
    groups = check_int("parameter_groups_number", parameter_groups_number, 1)
    strategy = _check_strategy(freeze_strategy)
    freeze_p = _check_freeze_p(freeze_p)
    length = int(check_steps("total_steps", total_steps) * 1.01)
    seed = _check_seed(seed)
    if groups <= 1 or freeze_p == 1:
        return np.zeros(length, np.int32)
    if strategy == CONTINUOUS_STRATEGY:
        return _continuous_sequence(groups, freeze_p, length)
    return _interval_sequence(groups, freeze_p, length, seed)


def frozen_share(sequence, parameter_groups_number):
    """Estimates the share of block updates a sequence skips.

    Group `k` leaves about `k / G` of the blocks frozen (exactly `k * stride` of them), so
    the estimate is the mean of `k / G` over the steps: about 0.11 for the interval
    strategy and 0.15 for the continuous one with G=10, p=0.7.

    Args:
        sequence: 1-D integer array of group indices, e.g. from
            `generate_freeze_index_sequence`.
        parameter_groups_number: int, the number of groups `G` (>= 1).

    Returns:
        A float in [0, 1).

    Example:

    >>> frozen_share(np.array([0, 0, 1, 3]), 4)
    0.25
    """
    groups = check_int("parameter_groups_number", parameter_groups_number, 1)
    sequence = _strategy_array(sequence, "sequence")
    _check_indices(sequence, groups, "sequence")
    return float(sequence.mean() / groups) if len(sequence) else 0.0


def _strategy_array(strategy, name):
    """`strategy` as a 1-D np.int32 array; list/tuple of ints, integer array or tensor."""
    if isinstance(strategy, (list, tuple)):
        for element in strategy:
            if isinstance(element, bool) or not isinstance(element, (int, np.integer)):
                raise ValueError(
                    f"Every element of `{name}` must be an int, got {element!r} "
                    f"({type(element).__name__})."
                )
        return np.asarray(strategy, np.int64).astype(np.int32)
    if tf.is_tensor(strategy) or isinstance(strategy, np.ndarray):
        array = np.asarray(strategy)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"`{name}` given as an array or tensor must be 1-D with an integer dtype, got "
                f"shape {array.shape} and dtype {array.dtype}."
            )
        return array.astype(np.int32)
    raise TypeError(
        f"`{name}` must be None, a list or tuple of ints, a NumPy array or a tensor, got "
        f"{type(strategy).__name__}."
    )


def _check_indices(strategy, groups, name):
    bad = np.flatnonzero((strategy < 0) | (strategy >= groups))
    if len(bad):
        raise ValueError(
            f"`{name}` holds group indices in [0, {groups}), got {int(strategy[bad[0]])} at "
            f"position {int(bad[0])}."
        )


def round_robin(groups):
    """The sequence of a FreezeOpt given no strategy: every group once, in order."""
    return np.arange(groups, dtype=np.int32)
