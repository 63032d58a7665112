"""What a compiled train step runs: the op types of its graphs, counted.

Used by `scripts/bench_step_ops.py` (what one configuration's step runs that another's does
not) and by the test that BoostModel's step without boost options runs keras.Model's ops.
Deterministic, so it explains a time difference without noise.
"""

import collections


def train_functions(model):
    """The tf.functions behind `model.train_function` (Keras' loop, or one per freeze group)."""
    function = model.train_function
    if hasattr(function, "tracing_counts"):  # keras_boost's per-group train function
        return list(function._on_iterator.values())
    cells = [c.cell_contents for c in function.__closure__ or ()]
    return [c for c in cells if hasattr(c, "experimental_get_tracing_count")]


def op_counts(model):
    """A `collections.Counter` of op types over every traced train function of `model`,
    with every function they call. `model.fit` must have traced them (one step is enough)."""
    counts = collections.Counter()
    for function in train_functions(model):
        for concrete in function._list_all_concrete_functions():
            graph_def = concrete.graph.as_graph_def()
            counts.update(node.op for node in graph_def.node)
            for library_function in graph_def.library.function:
                counts.update(node.op for node in library_function.node_def)
    return counts
