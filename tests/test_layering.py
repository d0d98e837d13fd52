"""The layering the design promises, read from the sources (imports at any depth, function-level
ones included, since those are what hide a cycle): tools -> export -> runtime, never back, and
no cycle between lantern modules."""
import ast
import os

import pytest

import lantern.export
import lantern.runtime
import lantern.tools

LAYERS = {"lantern.runtime": 0, "lantern.export": 1, "lantern.tools": 2}  # a layer imports its own and lower ones


def modules():
    """{module name: source path} of every lantern module."""
    out = {}
    for package in (lantern.runtime, lantern.export, lantern.tools):
        root = package.__path__[0]
        for folder, _, files in os.walk(root):
            for file in files:
                if file.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, file), root)[:-3].replace(os.sep, ".")
                    name = package.__name__ if rel == "__init__" else f"{package.__name__}.{rel}"
                    out[name.removesuffix(".__init__")] = os.path.join(folder, file)
    return out


def imported_names(path):
    """(line, dotted name) of every import in a file, at any depth."""
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)


def layer_of(name):
    return next((LAYERS[p] for p in LAYERS if name == p or name.startswith(p + ".")), None)


def import_graph(sources):
    """{module: {lantern modules it imports}} (a name resolves to the longest module it starts with)."""
    graph = {}
    for module, path in sources.items():
        deps = set()
        for _, name in imported_names(path):
            while name and name not in sources:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):  # a package's own __init__
                deps.add(name)
        graph[module] = deps
    return graph


def cycles(graph):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def upward_imports(sources):
    bad = []
    for module, path in sources.items():
        for line, name in imported_names(path):
            target = layer_of(name)
            if target is not None and target > layer_of(module):
                bad.append(f"{module}:{line} imports {name}")
    return sorted(set(bad))


def test_dependencies_point_one_way():
    """runtime imports no export or tools module; export imports no tools module."""
    assert upward_imports(modules()) == []


def test_no_import_cycle_between_modules():
    assert cycles(import_graph(modules())) == []


@pytest.mark.parametrize("layer, text", [("runtime", "from lantern.export import checkpoints\n"),
                                         ("export", "def f():\n    from lantern.tools import tune\n"),
                                         ("runtime", "import lantern.tools.tune\n")])
def test_the_checks_see_a_wrong_import(tmp_path, layer, text):
    """The same checks on the real sources plus one module that imports upwards (function-level too)."""
    sources = modules()
    path = tmp_path / "upward.py"
    path.write_text(text)
    sources[f"lantern.{layer}.upward"] = str(path)
    assert [b for b in upward_imports(sources) if b.startswith(f"lantern.{layer}.upward:")]


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
