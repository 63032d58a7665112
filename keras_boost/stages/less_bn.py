"""LessBN at a boost level: the model rewrite that removes the BatchNorms a model can do without.

`BoostModel(inputs, outputs, boost_level="O1")` runs it on the user's graph before Keras
builds the model (the rewrite itself: `keras_boost.graph.less_bn`); what it removed is the
model's `less_bn_report`. MindSpore's name: `mindspore.boost.less_batch_normalization.LessBN`.
"""

import keras

from keras_boost import _keras_compat, _warnings
from keras_boost.core.rewrite import ModelRewrite
from keras_boost.graph.less_bn import LessBN, keep_output_names


class LessBNRewrite(ModelRewrite):
    """The level's LessBN, with its FN head (`fn_flag`) on the classifier outputs."""

    feature = "less_bn"
    attribute = "less_bn_report"

    def applies(self, boost_config):
        return boost_config is not None and boost_config.enabled("less_bn")

    def rewrite(self, model, boost_config):
        measured = boost_config.measured("less_bn")  # a measured level: FN only where BatchNorms went
        return LessBN(model, fn_flag=boost_config.params["less_bn"]["fn_flag"], fn_needs_removal=measured,
                      share_layers=True, fn_outputs="classifiers" if measured else "all")

    def adopt(self, model, rewritten):
        super().adopt(model, rewritten)
        if rewritten is not None:
            keep_output_names(rewritten, model)  # the user's graph's names, whatever layer now ends an output

    def record(self, rewritten):
        return rewritten.less_bn_report

    def subclassed_error(self, model, boost_config):
        return TypeError(f"boost_level={boost_config.level!r} includes LessBN, which rewrites a graph of layer calls, "
                         f"and {type(model).__name__} is a subclassed model: build the BoostModel functionally "
                         "(BoostModel(inputs, outputs, boost_level=...)), or keep the level's other features "
                         "with LessBN switched off: boost_config={'boost': {'mode': 'manual', 'less_bn': False}}")

    def check_compile(self, model, loss):
        """An FN head is a cosine-similarity classifier, its outputs within ±multiplier: a regression
        loss on one without an activation after it gets a warning (a regression with two or more
        units looks like a classifier when the graph is rewritten)."""
        report = model.less_bn_report
        if report is None or not report.fn_heads or loss is None:
            return
        paths = [path for path, _ in keras.tree.flatten_with_path(_keras_compat.functional_structure(model)[1])]
        for index, head in _linear_fn_head_outputs(model).items():
            keys = {model.output_names[index]} | ({paths[index][0]} if paths[index] else set())
            if isinstance(loss, dict):
                given = next((loss[key] for key in keys if key in loss), None)
            elif isinstance(loss, (list, tuple)):
                given = loss[index] if index < len(loss) else None
            else:
                given = loss
            if _loss_name(given) in _REGRESSION_LOSSES:
                _warnings.warn(
                    f"loss={_loss_name(given)!r} on output {model.output_names[index]!r}: boost level "
                    f"{getattr(model.auto_boost, 'level', 'O1/O2')!r} replaced its Dense layer '{head}' by an FN head "
                    "(LessBN's fn_flag, a cosine-similarity classifier whose outputs stay within ±its multiplier), "
                    "which fits a regression worse than the Dense. If this output is a regression, build the "
                    "BoostModel without LessBN (BatchNorms kept, no FN head): BoostModel(inputs, outputs, "
                    "boost_level=..., boost_config={'boost': {'mode': 'manual', 'less_bn': False}}).",
                    UserWarning)

    def report(self, model):
        report = getattr(model, "less_bn_report", None)
        if report is None:
            return {}
        return {"batchnorms_removed": f"{report.num_removed} of {report.num_removed + report.num_kept}"}


_REGRESSION_LOSSES = {"mean_squared_error", "mse", "mean_absolute_error", "mae", "mean_absolute_percentage_error",
                      "mape", "mean_squared_logarithmic_error", "msle", "huber", "huber_loss", "log_cosh", "logcosh"}


def _loss_name(loss):
    if isinstance(loss, str):
        return loss
    fn = getattr(loss, "fn", loss)  # a Keras Loss wraps its function
    return getattr(fn, "__name__", None)


def _linear_fn_head_outputs(model):
    """{output index: FN head name} for the outputs an FN head produces directly (no activation
    after it: the output is the head's bounded cosine logits)."""
    from keras_boost.graph.layers import FNHead

    layers = [_keras_compat.inbound_node(tensor).operation for tensor in model.outputs]
    return {index: layer.name for index, layer in enumerate(layers) if isinstance(layer, FNHead)}
