"""The layering the design promises, read from the sources (imports at any depth, function-level
ones included, since those are what hide a cycle): tools -> export -> runtime, never back, and
no cycle between lantern modules."""
import ast
import os
import sys

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


# ---------------------------------------------------------------------------------------------
# Function-level imports: only where a file-top one would cost something


def _top_level_nodes(tree):
    """Import nodes that run when the module is imported (not inside a function)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _function_level_nodes(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    yield inner


def _names(node):
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.module and node.level == 0:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _resolve(name, sources):
    """The lantern module a dotted name imports (the longest module it starts with), or None."""
    while name and name not in sources:
        name = name.rpartition(".")[0]
    return name or None


def _packages_of(module):
    """A module and the packages above it: importing a.b.c runs a, a.b and a.b.c."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


def _third_party(name):
    """The optional third-party package a name imports (None: stdlib, numpy, lantern)."""
    top = name.split(".")[0]
    return None if top in sys.stdlib_module_names or top in ("numpy", "lantern", "__future__") else top


def _top_level_imports(sources):
    """{module: (lantern modules, optional third-party packages) its file-top imports name}."""
    out = {}
    for module, path in sources.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        lantern_deps, packages = set(), set()
        for node in _top_level_nodes(tree):
            for name in _names(node):
                target = _resolve(name, sources)
                if target is not None:
                    lantern_deps.update(m for m in _packages_of(target) if m != module and m in sources)
                elif _third_party(name):
                    packages.add(_third_party(name))
        out[module] = (lantern_deps, packages)
    return out


def _closure(start, top):
    """(lantern modules, optional packages) that importing the modules `start` runs."""
    seen, packages, todo = set(), set(), list(start)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        deps, pkgs = top[module]
        packages |= pkgs
        todo.extend(deps)
    return seen, packages


def function_level_lantern_imports(sources):
    """(module, line, imported lantern module) of every import inside a function."""
    for module, path in sources.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in _function_level_nodes(tree):
            targets = {_resolve(n, sources) for n in _names(node)} - {None}
            for target in sorted(targets):
                if not any(t != target and t.startswith(target + ".") for t in targets):  # from pkg import mod
                    yield module, node.lineno, target


def count_top_level_lantern_imports(sources):
    count = 0
    for path in sources.values():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        count += sum(any(_resolve(n, sources) for n in _names(node)) for node in _top_level_nodes(tree))
    return count


def hoistable_imports(sources):
    """Function-level lantern imports a file-top import could replace: it would close no import
    cycle and pull in no optional package (torch, onnx, onnxruntime, tensorrt, ...) that the
    module does not already import at its top."""
    top = _top_level_imports(sources)
    found = []
    for module, line, target in function_level_lantern_imports(sources):
        if target == module or module.startswith(target + "."):
            continue
        reached, packages = _closure(_packages_of(target), top)
        _, own = _closure([module], top)
        if module in reached or not packages <= own:
            continue  # a cycle, or a dependency the module does not have at its top
        found.append(f"{module}:{line} imports {target} inside a function")
    return found


def test_function_level_lantern_imports_only_where_needed():
    """A lantern import inside a function must avoid a cycle or an optional package
    (torch above all: the `cpu` install runs lantern-run without it); anything else goes at the
    top of the file, where a reader sees the module's dependencies."""
    assert hoistable_imports(modules()) == []


def test_the_hoist_check_sees_a_needless_function_level_import(tmp_path):
    sources = modules()
    path = tmp_path / "needless.py"
    path.write_text("def f():\n    from lantern.runtime.errors import LanternError\n    return LanternError\n")
    sources["lantern.runtime.needless"] = str(path)
    assert hoistable_imports(sources) == [f"lantern.runtime.needless:2 imports lantern.runtime.errors inside a function"]
