"""LessBN: rewrite a functional Keras model without the BatchNorms it can do without.

keras_boost's form of MindSpore's `LessBN` (`mindspore.boost.less_batch_normalization`).
MindSpore matches 16 fixed node patterns in its compiled graph; here the same intent
is stated as structural rules on the Keras call graph, so they need no layer names and
apply to any functional or Sequential model. A BatchNormalization (BN) call is removed
(replaced by its input) when one of these rules marks it:

1. Residual Add (`residual-branch`, `shortcut`; MindSpore patterns 1-6). For each `Add`
   whose inputs share an ancestor, each input's *branch* is the set of its ancestors
   that are not ancestors of another input. If no branch contains a merge layer and
   exactly one branch holds the most convolutions (the residual branch) and that
   branch has no depthwise or grouped convolution, the last BN of the residual
   branch (the one nearest the Add) is kept and every other BN on it is removed, and
   every BN on the other branches (a projection shortcut's BN) is removed. A BN before
   the fork, such as a pre-activation BN feeding both the shortcut and the branch of a
   ResNetV2 projection block, is on neither branch and is kept.
2. Expansion (`expansion`; patterns 7-9, 11). A BN directly after a 1x1 convolution
   whose output goes, through activations and padding only, into a depthwise or
   grouped convolution: the expansion BN of an inverted-residual block.
3. Head (`head`; pattern 10). A BN directly after a convolution whose output goes,
   through activations and padding only, into a global pooling layer.
4. Dense input (`dense-input`; patterns 12-14). A BN that reads a `Concatenate` output
   and feeds a convolution through activations: BN1 of a DenseNet layer and the BN of
   a DenseNet transition.
5. First dense layer (`dense-first-layer`; patterns 15-16). For a `Concatenate` of a
   tensor with a transform of it (a dense connection) whose input is not itself a
   concatenation, the last BN of the transform when it has at least two BNs: BN2 of
   the first layer of a dense block. MindSpore matches this only after the stem
   max-pool; the rule here also covers the first layer after each transition, so
   every dense layer loses exactly one BN.

The stem BN, the BN every other BN depends on, is never removed, so a network never
loses its first normalisation. Nor is a BN that holds what it learnt: a frozen one
(`trainable=False`), or one whose moving statistics are no longer their initial values
(pretrained or trained weights; LessBN is for training from scratch): without it the
network would compute something else, so it is kept, with one warning naming it. A layer called more than once is removed only when
every one of its calls is marked. A nested model is one opaque layer: it is copied
whole, BNs included.

With `fn_flag=True`, every Dense layer that produces a model output (directly or
through activation layers) becomes an `FNHead` initialised from its kernel; its bias
is dropped as in MindSpore, and a non-linear activation is kept as an `Activation`
layer after the head.

The input model is never changed: kept layers are fresh copies (same class, config,
name, weights and variable paths) so training the result leaves the input alone; with
`share_layers=True` (what a `BoostModel` at a boost level uses) the result calls the
input's own layer objects instead. The result is
uncompiled; it has the input model's class when that class can be built from
`(inputs, outputs, name=...)`, otherwise it is a plain functional `keras.Model`
(always for Sequential inputs). A model with nothing to remove comes back as such a
copy of the same graph, with a warning.
"""

import contextlib
import dataclasses
import inspect
import math
import logging

import keras
import numpy as np

from keras_boost import _warnings
from keras_boost._keras_compat import Functional, inbound_node
from keras_boost.graph.layers import FNHead

_LOG = logging.getLogger(__name__)

_L = keras.layers
_PLAIN_CONVS = (_L.Conv1D, _L.Conv2D, _L.Conv3D)
_DEPTHWISE_CONVS = (_L.DepthwiseConv1D, _L.DepthwiseConv2D)
_CONVS = _PLAIN_CONVS + _DEPTHWISE_CONVS + (
    _L.SeparableConv1D,
    _L.SeparableConv2D,
    _L.Conv1DTranspose,
    _L.Conv2DTranspose,
    _L.Conv3DTranspose,
)
_ACTIVATIONS = (_L.Activation, _L.ReLU, _L.LeakyReLU, _L.ELU, _L.PReLU, _L.Softmax)
_TRANSPARENT = _ACTIVATIONS + (_L.ZeroPadding1D, _L.ZeroPadding2D, _L.ZeroPadding3D)
_GLOBAL_POOLS = (
    _L.GlobalAveragePooling1D,
    _L.GlobalAveragePooling2D,
    _L.GlobalAveragePooling3D,
    _L.GlobalMaxPooling1D,
    _L.GlobalMaxPooling2D,
    _L.GlobalMaxPooling3D,
)


@dataclasses.dataclass(frozen=True)
class LessBNReport:
    """What `LessBN` changed in a model, attached to its result as `less_bn_report`.

    Args:
        removed: BN layer name -> the rule that removed it (`"residual-branch"`,
            `"shortcut"`, `"expansion"`, `"head"`, `"dense-input"`,
            `"dense-first-layer"`), in graph order.
        kept: names of the BN layers left in the model, in graph order.
        fn_heads: names of the Dense layers replaced by `FNHead` (empty without
            `fn_flag`).
        held: BN layer name -> why it was kept although a rule marks it (`"frozen"`: not
            trainable; `"trained"`: its moving statistics are no longer their initial
            values, as in pretrained weights; `"output"`: see `not_classifiers`); these
            names are in `kept` too.
        not_classifiers: with `fn_flag` and `fn_outputs="classifiers"`, the names of the
            layers producing outputs that no classifier Dense produces; when there are any,
            every BatchNorm stays (`held` gives them the reason `"output"`).
    """

    removed: dict
    kept: tuple
    fn_heads: tuple = ()
    held: dict = dataclasses.field(default_factory=dict)
    not_classifiers: tuple = ()

    @property
    def num_removed(self):
        return len(self.removed)

    @property
    def num_kept(self):
        return len(self.kept)

    def summary(self):
        """One line: counts of removed and kept BNs and the FN heads."""
        heads = ", ".join(self.fn_heads) or "none"
        left = (f"; outputs not from a classifier Dense: {', '.join(self.not_classifiers)}"
                if self.not_classifiers else "")
        return (
            f"LessBN removed {self.num_removed} of {self.num_removed + self.num_kept} "
            f"BatchNormalization layers, kept {self.num_kept}; FN heads: {heads}{left}."
        )


def LessBN(model, fn_flag=False, fn_needs_removal=False, share_layers=False,  # noqa: N802 - MindSpore's name
           fn_outputs="all"):
    """Returns a copy of a functional or Sequential model without redundant BNs.

    See the module docstring for the rules. The result carries a `LessBNReport` as
    `result.less_bn_report`; the report is also logged at INFO level.

    Args:
        model: a functional or Sequential `keras.Model` (built). It is not modified.
        fn_flag: bool, whether to replace the Dense classifier producing each model
            output by an `FNHead`. Defaults to `False`.
        fn_needs_removal: bool, keras_boost's: add the FN head only when a BatchNorm is
            removed (it makes up for the removed normalisation; with none removed the
            result is the same graph as `model`). Boost levels pass True unless the
            configuration gives the `less_bn` section. Defaults to `False` (MindSpore's:
            `fn_flag` alone decides).
        share_layers: bool, keras_boost's: the result calls `model`'s own layer objects
            (kept layers are not copied), so it trains their weights, and what is done to
            them afterwards (`layer.trainable = False`, a nested base unfrozen for fine-tuning)
            applies to it. `BoostModel(inputs, outputs, boost_level=...)` passes True: the
            layers are the user's. Defaults to `False` (MindSpore's: a new network).
        fn_outputs: "all" or "classifiers", keras_boost's: which Dense layers producing an
            output `fn_flag` replaces. "all" (default, MindSpore's) every one, and a model
            without one is a `ValueError`. "classifiers": those with two or more units or a
            softmax/sigmoid; and when any output comes from no such Dense (a `Dense(1)`
            without one may be a regression; a convolution classifier has no Dense for the
            head), every BatchNorm stays, with a warning (`report.not_classifiers`). Boost
            levels pass "classifiers" unless the configuration gives the `less_bn` section.

    Returns:
        A new, uncompiled model sharing no layer with `model`.

    Example:

    >>> base = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    >>> lean = LessBN(base, fn_flag=True)
    >>> lean.less_bn_report.num_removed, lean.less_bn_report.num_kept
    (36, 17)
    """
    if not isinstance(fn_flag, bool):
        raise TypeError(f"`fn_flag` must be a bool (True or False), got {fn_flag!r}.")
    if not isinstance(fn_needs_removal, bool):
        raise TypeError(f"`fn_needs_removal` must be a bool (True or False), got {fn_needs_removal!r}.")
    if not isinstance(share_layers, bool):
        raise TypeError(f"`share_layers` must be a bool (True or False), got {share_layers!r}.")
    if fn_outputs not in ("all", "classifiers"):
        raise ValueError(f"`fn_outputs` must be 'all' or 'classifiers', got {fn_outputs!r}.")
    view = _graph_view(model)
    graph = _Graph(view.outputs)
    removed_nodes, held = _plan_removals(graph)
    removed_layers = _removed_layers(graph, removed_nodes)
    others = _not_classifier_outputs(graph) if fn_flag and fn_outputs == "classifiers" else []
    if others and removed_layers:  # no FN head could make up for the BatchNorms on those outputs
        for i in removed_nodes:
            held.setdefault(graph.layer(i).name, "output")
        removed_nodes, removed_layers = {}, set()
    heads = (_head_denses(graph, model.name, fn_outputs)
             if fn_flag and (removed_layers or not fn_needs_removal) else [])
    with _variable_scope(model):
        clone = _rebuild(view, removed_layers, heads, share_layers)
    result = _with_class_of(model, clone)
    keep_output_names(model, result)
    result.less_bn_report = _report(graph, removed_nodes, removed_layers, heads, held, others)
    _LOG.info("%s: %s", model.name, result.less_bn_report.summary())
    if others and "output" in held.values():
        _warnings.warn(
            f"LessBN kept every BatchNormalization layer of model '{model.name}': its output(s) "
            f"{', '.join(repr(name) for name in others)} come from no classifier Dense (a Dense with two or more units, "
            "or with a softmax or sigmoid) for the FN head, which makes up for removed BatchNorms (on a two-headed "
            "model a Dense(1) regression's loss was 6x plain Keras' with them removed); a boost level then leaves its "
            "gradient centralization off too. To remove them anyway (MindSpore's LessBN, an FN head on every Dense "
            "output), give the level's less_bn section: boost_config={'less_bn': {'fn_flag': True}}.")
        return result
    if any(why in _HELD_WHY for why in held.values()):
        reasons = sorted({why for why in held.values() if why in _HELD_WHY})
        _warnings.warn(
            f"LessBN kept {len(held)} BatchNormalization layers of model '{model.name}' that its rules would remove, "
            f"because they hold what they learnt ({' and '.join(_HELD_WHY[r] for r in reasons)}): without them the "
            f"network would compute something else. First ones: {', '.join(list(held)[:4])}. LessBN is for "
            "training from scratch: apply it (or the boost level) to a model whose BatchNorms are new.")
    if not removed_layers:
        unchanged = ("the result is a copy of the same graph" if not heads else
                     "the result is a copy of the same graph with an FN head")
        if fn_flag and fn_needs_removal:
            unchanged += (", without an FN head, and a boost level leaves its gradient centralization off: both "
                          "make up for removed BatchNorms")
        _warnings.warn(f"LessBN found no BatchNormalization layer to remove in model '{model.name}'; {unchanged}."
                       f"{_nested_hint(model)}")
    return result


def removed_batchnorms(model):
    """How many BatchNorms LessBN removed from `model` (its `less_bn_report`), or None where LessBN did not run.

    A boost level's gradient centralization and gradient freezing are switched off where it is 0
    or None: both rely on LessBN's changes to keep accuracy (docs/auto_boost.md).
    """
    report = getattr(model, "less_bn_report", None)
    return None if report is None else report.num_removed


def _nested_hint(model):
    """A sentence for a model whose BatchNorms sit in nested models (opaque to LessBN), else ''."""
    from keras_boost._keras_compat import flatten_layers

    nested = {}
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            count = sum(isinstance(inner, _L.BatchNormalization) for inner in flatten_layers(layer))
            if count:
                nested[layer.name] = count
    if not nested:
        return ""
    listed = ", ".join(f"'{name}' ({count} BatchNormalization layers)" for name, count in nested.items())
    return (f" The nested model {listed} is one opaque layer to LessBN: build its layers into this model "
            "instead (keras.applications take `input_tensor=`, e.g. `base = keras.applications.ResNet50("
            "include_top=False, input_tensor=inputs)`, then `base.output`) to let LessBN remove its BatchNorms.")


def _variable_scope(model):
    """The name scope keeping every variable path: Sequential models build under their name."""
    if isinstance(model, keras.Sequential):
        return keras.name_scope(model.name)
    return contextlib.nullcontext()


def _graph_view(model):
    """An uncompiled functional model over the same layer calls as `model`."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model (functional or Sequential), got {type(model).__name__}."
        )
    if isinstance(model, keras.Sequential):
        try:
            inputs, outputs = model.inputs[0], model.outputs[0]
        except AttributeError as error:
            raise ValueError(
                f"Sequential model '{model.name}' has no defined input; build it with "
                "keras.Input before calling LessBN."
            ) from error
        return keras.Model(inputs, outputs, name=model.name)
    if not isinstance(model, Functional):
        raise TypeError(
            "LessBN needs a functional or Sequential model (a graph of layer calls); "
            f"got the subclassed model {type(model).__name__}."
        )
    return keras.Model(model.input, model.output, name=model.name)


def _node_of(tensor):
    return inbound_node(tensor)


def _topological_nodes(tensors):
    order, seen = [], set()
    stack = [(_node_of(tensor), False) for tensor in tensors]
    while stack:
        node, parents_done = stack.pop()
        if parents_done:
            order.append(node)
        elif id(node) not in seen:
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((parent, False) for parent in node.parent_nodes)
    return order


class _Graph:
    """The layer calls of a functional model in topological order.

    Node i's ancestors (itself included) are the bits of the int `ancestors[i]`.
    """

    def __init__(self, outputs):
        self.nodes = _topological_nodes(outputs)
        index = {id(node): i for i, node in enumerate(self.nodes)}
        self.parents = [
            list(dict.fromkeys(index[id(parent)] for parent in node.parent_nodes))
            for node in self.nodes
        ]
        self.children = [[] for _ in self.nodes]
        self.ancestors = []
        for i, parents in enumerate(self.parents):
            mask = 1 << i
            for parent in parents:
                self.children[parent].append(i)
                mask |= self.ancestors[parent]
            self.ancestors.append(mask)
        self.output_nodes = sorted({index[id(_node_of(tensor))] for tensor in outputs})

    def layer(self, i):
        return self.nodes[i].operation

    def is_a(self, i, types):
        return isinstance(self.layer(i), types)

    def members(self, mask):
        return [i for i in range(len(self.nodes)) if mask >> i & 1]

    def bns(self, mask=-1):
        return [i for i in self.members(mask) if self.is_a(i, _L.BatchNormalization)]

    def single_parent(self, i):
        return self.parents[i][0] if len(self.parents[i]) == 1 else None

    def consumer(self, i):
        """The first layer after node i past activations and padding, on a single path."""
        while len(self.children[i]) == 1:
            i = self.children[i][0]
            if not self.is_a(i, _TRANSPARENT):
                return self.layer(i)
        return None

    def has_merge(self, mask):
        return any(len(self.parents[i]) > 1 for i in self.members(mask))

    def last_bns(self, start, mask):
        """The BNs in `mask` reached first when walking back from node `start`."""
        found, seen, stack = [], set(), [start]
        while stack:
            i = stack.pop()
            if i in seen or not mask >> i & 1:
                continue
            seen.add(i)
            if self.is_a(i, _L.BatchNormalization):
                found.append(i)
            else:
                stack.extend(self.parents[i])
        return found


def _is_depthwise(layer):
    if isinstance(layer, _DEPTHWISE_CONVS):
        return True
    return isinstance(layer, _PLAIN_CONVS) and layer.groups > 1


def _is_pointwise(layer):
    return (
        isinstance(layer, _PLAIN_CONVS)
        and layer.groups == 1
        and all(size == 1 for size in layer.kernel_size)
    )


def _residual_rule(graph):
    for i in range(len(graph.nodes)):
        if graph.is_a(i, _L.Add) and len(graph.parents[i]) > 1:
            yield from _residual_block(graph, graph.parents[i])


def _residual_block(graph, inputs):
    masks = [graph.ancestors[i] for i in inputs]
    common, branches = -1, []
    for k, mask in enumerate(masks):
        common &= mask
        others = 0
        for other in masks[:k] + masks[k + 1 :]:
            others |= other
        branches.append(mask & ~others)
    if not common or any(graph.has_merge(branch) for branch in branches):
        return
    depths = [sum(graph.is_a(i, _CONVS) for i in graph.members(b)) for b in branches]
    deepest = depths.index(max(depths))
    residual = branches[deepest]
    if depths.count(max(depths)) > 1 or any(
        _is_depthwise(graph.layer(i)) for i in graph.members(residual)
    ):
        return
    last = graph.last_bns(inputs[deepest], residual)
    for bn in graph.bns(residual):
        if bn not in last:
            yield bn, "residual-branch"
    for k, branch in enumerate(branches):
        if k != deepest:
            for bn in graph.bns(branch):
                yield bn, "shortcut"


def _expansion_rule(graph):
    for bn in graph.bns():
        conv = graph.single_parent(bn)
        if conv is not None and _is_pointwise(graph.layer(conv)):
            if _is_depthwise(graph.consumer(bn)):
                yield bn, "expansion"


def _head_rule(graph):
    for bn in graph.bns():
        conv = graph.single_parent(bn)
        if conv is not None and graph.is_a(conv, _CONVS):
            if isinstance(graph.consumer(bn), _GLOBAL_POOLS):
                yield bn, "head"


def _dense_input_rule(graph):
    for bn in graph.bns():
        concat = graph.single_parent(bn)
        if concat is not None and graph.is_a(concat, _L.Concatenate):
            if isinstance(graph.consumer(bn), _CONVS):
                yield bn, "dense-input"


def _dense_first_layer_rule(graph):
    for i in range(len(graph.nodes)):
        if not graph.is_a(i, _L.Concatenate):
            continue
        for source in graph.parents[i]:
            for transform in graph.parents[i]:
                if source == transform or not graph.ancestors[transform] >> source & 1:
                    continue
                branch = graph.ancestors[transform] & ~graph.ancestors[source]
                if graph.is_a(source, _L.Concatenate) or graph.has_merge(branch):
                    continue
                if len(graph.bns(branch)) >= 2:
                    for bn in graph.last_bns(transform, branch):
                        yield bn, "dense-first-layer"


_RULES = (
    _residual_rule,
    _expansion_rule,
    _head_rule,
    _dense_input_rule,
    _dense_first_layer_rule,
)


def _stem_bn(graph):
    bns = graph.bns()
    for stem in bns:
        if all(graph.ancestors[bn] >> stem & 1 for bn in bns):
            return stem
    return None


def _plan_removals(graph):
    """(BN node index -> rule name, for every BN call a rule marks and that may go;
    BN layer name -> why it stays although a rule marks it)."""
    removed, held = {}, {}
    for rule in _RULES:
        for bn, name in rule(graph):
            removed.setdefault(bn, name)
    removed.pop(_stem_bn(graph), None)
    for bn in list(removed):
        why = _holds_what_it_learnt(graph.layer(bn))
        if why is not None:
            held[graph.layer(bn).name] = why
            del removed[bn]
    return dict(sorted(removed.items())), held


_HELD_WHY = {"frozen": "frozen: trainable=False", "trained": "moving statistics no longer at their initial values: "
             "pretrained or trained weights"}


def _holds_what_it_learnt(bn):
    """Why a BN must stay whatever the rules say, or None: it is frozen, or its moving statistics
    are no longer their initial values (pretrained or trained weights)."""
    if not bn.trainable:
        return "frozen"
    for variable, initializer in ((bn.moving_mean, bn.moving_mean_initializer),
                                  (bn.moving_variance, bn.moving_variance_initializer)):
        start = _constant_of(initializer)
        if start is not None and not np.all(keras.ops.convert_to_numpy(variable) == start):
            return "trained"
    return None


def _constant_of(initializer):
    """The value a constant initializer (zeros, ones, a constant) fills with; None for any other."""
    initializer = keras.initializers.get(initializer)
    if isinstance(initializer, keras.initializers.Zeros):
        return 0.0
    if isinstance(initializer, keras.initializers.Ones):
        return 1.0
    if isinstance(initializer, keras.initializers.Constant):
        return float(initializer.value)
    return None


def _removed_layers(graph, removed_nodes):
    """Ids of the BN layers all of whose calls are marked."""
    marked = {id(graph.layer(i)) for i in removed_nodes}
    unmarked = {id(graph.layer(i)) for i in graph.bns() if i not in removed_nodes}
    return marked - unmarked


def has_dense_head(model):
    """Whether `LessBN(model, fn_flag=True)` finds a Dense layer producing an output to replace."""
    try:
        _head_denses(_Graph(_graph_view(model).outputs), model.name)
    except ValueError:
        return False
    return True


_CLASSIFIER_ACTIVATIONS = {"softmax", "sigmoid", "log_softmax"}


def _is_classifier(dense, passed):
    """Whether a Dense producing an output (through the activation layers `passed`) is a
    classifier: two or more units, or a softmax/sigmoid. A Dense(1) without one may be a
    regression, where a cosine-similarity head cannot reach the targets."""
    if dense.units >= 2:
        return True
    activations = [dense.activation] + [getattr(layer, "activation", None) for layer in passed]
    return (any(isinstance(layer, _L.Softmax) for layer in passed)
            or any(getattr(fn, "__name__", None) in _CLASSIFIER_ACTIVATIONS for fn in activations))


def _output_ends(graph):
    """For each output: (the layer producing it, the layer found walking back through activation
    layers, the activation layers passed on the way)."""
    ends = []
    for i in graph.output_nodes:
        end, passed = i, []
        while graph.is_a(i, _ACTIVATIONS) and graph.single_parent(i) is not None:
            passed.append(graph.layer(i))
            i = graph.single_parent(i)
        ends.append((graph.layer(end), graph.layer(i), passed))
    return ends


def _output_denses(graph):
    """The Dense layers producing an output (through activation layers), each once, with the
    activation layers passed on the way."""
    found = []
    for _, layer, passed in _output_ends(graph):
        if isinstance(layer, _L.Dense) and all(layer is not dense for dense, _ in found):
            found.append((layer, passed))
    return found


def _head_denses(graph, model_name, fn_outputs="all"):
    """The Dense layers an FN head replaces."""
    found = _output_denses(graph)
    if not found and fn_outputs == "all":
        raise ValueError(
            f"fn_flag=True needs a Dense layer producing an output of model '{model_name}' "
            "(directly or through activation layers); it has none."
        )
    return [dense for dense, passed in found if fn_outputs == "all" or _is_classifier(dense, passed)]


def _not_classifier_outputs(graph):
    """Names of the layers producing the outputs that no classifier Dense produces (through
    activation layers): a Dense(1) without softmax or sigmoid, a convolution, anything else."""
    return [end.name for end, layer, passed in _output_ends(graph)
            if not (isinstance(layer, _L.Dense) and _is_classifier(layer, passed))]


FN_SCALE = 16.0  # the FN head's initial multiplier: a number, "mindspore" (1.0) or "adacos" (sqrt(2) ln(C-1))


def fn_head_scale(classes):
    """The FN head's initial multiplier for `classes` outputs (see `FN_SCALE`)."""
    if FN_SCALE == "mindspore":
        return 1.0
    if FN_SCALE == "adacos":
        return max(1.0, math.sqrt(2.0) * math.log(max(classes - 1, 1)))
    return float(FN_SCALE)


def _rebuild(view, removed_layers, heads, share_layers=False):
    """Clones `view` call by call: removed BNs become identity, heads become FNHead, kept layers
    copies (or, with `share_layers`, the same layer objects)."""
    head_ids = {id(head) for head in heads}
    copies, activations = [], {}

    def clone_function(layer):
        if id(layer) in removed_layers:
            return layer
        if id(layer) in head_ids:
            head = FNHead.from_dense(layer, initial_multiplier=fn_head_scale(layer.units))
            if layer.activation is not keras.activations.linear:
                activations[id(head)] = _L.Activation(
                    layer.activation, name=f"{layer.name}_activation"
                )
            return head
        if share_layers:
            return layer
        try:
            copy = layer.__class__.from_config(layer.get_config())
        except (TypeError, ValueError, NotImplementedError) as error:
            raise TypeError(
                f"LessBN copies every kept layer from its config, and layer '{layer.name}' "
                f"({type(layer).__name__}) cannot be rebuilt from its config: {error}. Give the class a "
                "get_config() that returns its constructor's arguments (and accept **kwargs in __init__), or "
                "pass share_layers=True (BoostModel(inputs, outputs, boost_level=...) does) to keep the layer "
                "objects themselves.") from error
        copies.append((layer, copy))
        return copy

    def call_function(layer, *args, **kwargs):
        if id(layer) in removed_layers:
            return args[0] if args else kwargs["inputs"]
        outputs = layer(*args, **kwargs)
        activation = activations.get(id(layer))
        return outputs if activation is None else activation(outputs)

    clone = keras.models.clone_model(
        view, clone_function=clone_function, call_function=call_function
    )
    for original, copy in copies:
        copy.set_weights(original.get_weights())
    return clone


def keep_output_names(model, result):
    """`result` answers to `model`'s output names. An FN head whose Dense had an activation
    ends in a new `Activation` layer (`<dense>_activation`), and Keras names a functional
    model's outputs after their last layers: without this, `compile`'s losses and metrics
    keyed by output name (`loss={"cls": ...}`) would no longer match, and the metrics'
    names (`cls_accuracy`) would change."""
    names = getattr(model, "output_names", None)
    if names and len(names) == len(result.outputs):
        result.output_names = list(names)


def _with_class_of(model, clone):
    """`clone` rebuilt as `type(model)` when that class takes (inputs, outputs, name)."""
    cls = type(model)
    if cls is Functional or isinstance(model, keras.Sequential):
        return clone
    try:
        inspect.signature(cls).bind(clone.input, clone.output, name=model.name)
    except TypeError:
        return clone
    return cls(clone.input, clone.output, name=model.name)


def _report(graph, removed_nodes, removed_layers, heads, held=None, others=()):
    removed, kept = {}, []
    for i in graph.bns():
        layer = graph.layer(i)
        if id(layer) in removed_layers:
            removed.setdefault(layer.name, removed_nodes[i])
        elif layer.name not in kept:
            kept.append(layer.name)
    return LessBNReport(removed=removed, kept=tuple(kept), fn_heads=tuple(h.name for h in heads), held=dict(held or {}),
                         not_classifiers=tuple(others))
