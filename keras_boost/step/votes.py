"""The workers' requests to stop `fit`, averaged with the updates (`keras_boost.callbacks.StopTogether`)."""

import tensorflow as tf

from keras_boost import distributed


class StopVotes:
    """Every worker's request to stop `fit`, averaged with each update's gradients.

    `vote` is this worker's request (1.0: a callback set `model.stop_training`), set between
    steps by `keras_boost.callbacks.StopTogether`; `agreed` is the mean of every worker's
    vote at the last update, identical on every worker and > 0 when one of them asked. So a
    stop asked on any worker takes effect on all of them after the next update, at no
    collective of its own (the vote rides in the gradients' allreduce). Plain TensorFlow
    variables of the step, outside the model: never saved, never broadcast.
    """

    def __init__(self):
        with tf.init_scope():
            self.vote = tf.Variable(0.0, trainable=False, name="stop_vote")
            self.agreed = tf.Variable(0.0, trainable=False, name="stop_agreed")

    def reset(self):
        self.vote.assign(0.0)
        self.agreed.assign(0.0)


def reduce_with_votes(reduce, grads, indices, votes=None, carries=False):
    """`reduce(grads, indices)`; with `votes`, every worker's stop request averaged too, into `votes.agreed`:
    as one more scalar in the gradients' own collective where the reduce `carries` it, else in its own."""
    if votes is None:
        return reduce(grads, indices)
    dense = [g for g in grads if not isinstance(g, tf.IndexedSlices) and g.dtype.is_floating]
    if carries and dense:  # in the group of the first dense gradient's dtype: 0/1 means are exact enough
        reduced = reduce(list(grads) + [tf.cast(votes.vote, dense[0].dtype)], list(indices) + [indices[-1]])
        grads, agreed = reduced[:-1], reduced[-1]
    else:
        grads, agreed = reduce(grads, indices), distributed.allreduce(votes.vote)
    votes.agreed.assign(tf.cast(agreed, tf.float32))
    return grads
