"""Horovod's elastic machinery, for keras_boost.fit.elastic (which reaches Horovod through here alone)."""


def object_state_class():
    """`horovod.common.elastic.ObjectState`."""
    from horovod.common.elastic import ObjectState

    return ObjectState


def internal_error_class():
    """`horovod.common.exceptions.HorovodInternalError`: a collective failed because a worker went away."""
    from horovod.common.exceptions import HorovodInternalError

    return HorovodInternalError


def run_fn(func, reset):
    """`horovod.common.elastic.run_fn`: runs `func`, restoring and resetting on a worker failure."""
    from horovod.common.elastic import run_fn as horovod_run_fn

    return horovod_run_fn(func, reset)
