"""The model-rewrite contract: a feature that changes a functional model's graph when a BoostModel is made.

A stage acts in the compiled step; a rewrite acts once, on the graph of layer calls, before
Keras builds the model (LessBN removes BatchNorms and puts an FN head on a classifier). The
registry lists the rewrites (`registry.rewrites()`); `BoostModel` runs those whose
`applies(boost_config)` holds, in order, and names none of them.
"""


class ModelRewrite:
    """Base of a model rewrite. Subclasses override what they need.

    Class attributes:
        feature: the boost configuration's feature that switches it on (its name in levels' tables).
        attribute: the model attribute that holds what the rewrite did (None where it did not
            run); `adopt` sets it on every BoostModel, so it can be read without `getattr`.
    """

    feature = None
    attribute = None

    def applies(self, boost_config):
        """Whether the level (a `config.BoostConfig`, or None without one) asks for this rewrite."""
        return False

    def rewrite(self, model, boost_config):
        """The rewritten `keras.Model` of functional `model` (whose layers it may share)."""
        return model

    def adopt(self, model, rewritten):
        """On the BoostModel `model` built from `rewritten` (None where the rewrite did not run):
        keeps what the rewrite did under `attribute`, and what the user's graph named."""
        if self.attribute is not None:
            setattr(model, self.attribute, None if rewritten is None else self.record(rewritten))

    def record(self, rewritten):
        """What `adopt` keeps of `rewritten` under `attribute`."""
        return None

    def subclassed_error(self, model, boost_config):
        """The TypeError for a level that asks for this rewrite on a subclassed model (no graph to rewrite)."""
        return TypeError(f"boost_level={boost_config.level!r} includes {type(self).__name__}, which rewrites a "
                         f"graph of layer calls, and {type(model).__name__} is a subclassed model: build the "
                         "BoostModel functionally (BoostModel(inputs, outputs, boost_level=...))")

    def check_compile(self, model, loss):
        """Warns or raises at `compile` where `loss` does not suit what the rewrite made."""

    def report(self, model):
        """{name: value}: what the rewrite did, for the report of `keras-boost train` and `bench`."""
        return {}
