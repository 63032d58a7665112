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
    assert imported <= {"copy", "json", "os", "warnings", "keras_boost._validation"}, imported


def test_keras_version_outside_the_range_fails_with_the_range():
    import pytest

    from keras_boost import _keras_compat

    with pytest.raises(ImportError, match=r"keras_boost supports Keras >=3.15,<3.16 .* has Keras 3.4.1"):
        _keras_compat.check_keras_version("3.4.1")
    with pytest.raises(ImportError, match="has Keras 3.16.0"):
        _keras_compat.check_keras_version("3.16.0")
    _keras_compat.check_keras_version("3.15.1")
