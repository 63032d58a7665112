"""Elastic training with Horovod (`keras_boost.elastic.run`, `BoostModelState`, `fit_elastic`).

It lives in `keras_boost/fit/elastic.py`, with the rest of what keras_boost adds around `fit`.
"""

from keras_boost.fit.elastic import *  # noqa: F403
from keras_boost.fit.elastic import __all__  # noqa: F401
