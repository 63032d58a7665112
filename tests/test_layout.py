"""The package's shape: no import circle, private Keras use in one module, config without TensorFlow."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "keras_boost"


def _module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path):
    """Every keras_boost module `path` imports, at any depth of the file (lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("keras_boost"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("keras_boost"))
    return found


def test_no_import_circle_between_modules():
    graph = {name: {m for m in _imports(path) if m in MODULES and m != name and m != "keras_boost"}
             for name, path in MODULES.items() if name != "keras_boost"}
    # the package __init__ only re-exports; every other module must form a DAG
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_keras_src_only_in_the_compat_module():
    users = sorted(name for name, path in MODULES.items() if "keras.src" in path.read_text())
    assert users == ["keras_boost._keras_compat"]


def test_config_imports_neither_tensorflow_nor_horovod():
    imported = set()
    for node in ast.walk(ast.parse(MODULES["keras_boost.config"].read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0] if not node.module.startswith("keras_boost") else node.module)
    assert not {"tensorflow", "horovod", "keras"} & imported, imported
    assert imported <= {"copy", "json", "os", "warnings", "keras_boost._validation", "keras_boost._warnings"}, imported


def test_keras_version_outside_the_range_fails_with_the_range():
    import pytest

    from keras_boost import _keras_compat

    with pytest.raises(ImportError, match=r"keras_boost supports Keras >=3.15,<3.16 .* has Keras 3.4.1"):
        _keras_compat.check_keras_version("3.4.1")
    with pytest.raises(ImportError, match="has Keras 3.16.0"):
        _keras_compat.check_keras_version("3.16.0")
    _keras_compat.check_keras_version("3.15.1")


# The folders from the bottom up (docs/architecture.md, "Layout"): a module imports only
# modules of its own folder or of a lower one, so a stage never runs back up into the loop.
LAYERS = (
    {"keras_boost._version", "keras_boost._versions", "keras_boost._startup", "keras_boost._warnings",
     "keras_boost._validation",
     "keras_boost._keras_compat", "keras_boost.config", "keras_boost.precision"},
    {"keras_boost.core"},
    {"keras_boost.distributed", "keras_boost.graph"},
    {"keras_boost.fit", "keras_boost.callbacks", "keras_boost.elastic"},
    {"keras_boost.stages"},
    {"keras_boost.optimizers"},
    {"keras_boost.step"},
    {"keras_boost.model"},
    {"keras_boost.mindspore"},
    {"keras_boost.app"},
)


def _layer(module):
    for height, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members):
            return height
    raise AssertionError(f"{module} is in no layer of LAYERS: add its folder there and to docs/architecture.md")


def test_every_import_runs_down_the_layers():
    upward = []
    for name, path in MODULES.items():
        if name == "keras_boost":  # the package's front door re-exports every layer
            continue
        for target in _imports(path):
            if target == "keras_boost":
                upward.append(f"{name} imports the package's front door (keras_boost/__init__.py)")
            elif target in MODULES and _layer(target) > _layer(name):
                upward.append(f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})")
    assert not upward, "\n".join(upward)


def test_horovod_is_imported_in_distributed_only():
    """The package's modules reach Horovod through `keras_boost.distributed` alone."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n == "horovod" or n.startswith("horovod.") for n in names) and not (
                    name == "keras_boost.distributed" or name.startswith("keras_boost.distributed.")):
                found.append(name)
    assert not found, found


def test_the_loop_imports_no_stage():
    """The loop knows the hook points, not the features: its stages come from the registry."""
    imported = _imports(MODULES["keras_boost.step.loop"])
    assert not [m for m in imported if m.startswith("keras_boost.stages")], imported


def test_no_class_name_is_defined_twice():
    """One class per feature: a name (`AdaSum`, `GradientAccumulation`...) names one class in the package."""
    seen = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen.setdefault(node.name, []).append(name)
    twice = {cls: modules for cls, modules in seen.items() if len(modules) > 1}
    assert not twice, twice
