"""The runner registry (lantern.runtime.backends.RUNNERS) is the one place runner names are spelled:
its records against the backends they open, and a check, read from the sources like the layering
test's, that no other module spells a runner name (so what a name implies cannot drift apart
again: tune once clocked tensorrt-torch as CPU work, and trt built no profiles for its trees)."""
import ast
import inspect

import pytest

from lantern.export import torch_backend
from lantern.export.tensorrt_build import FLAVORS
from lantern.runtime import backends
from lantern.runtime.backends import names, RUNNERS, runner
from lantern.runtime.backends.onnxruntime import OnnxRuntimeBackend
from lantern.runtime.backends.onnxruntime_torch import OnnxRuntimeTorchBackend
from lantern.runtime.backends.tensorrt import TensorRTBackend
from lantern.runtime.backends.tensorrt_torch import TensorRTTorchBackend
from lantern.runtime.backends.torch import TorchBackend
from lantern.runtime.errors import LanternError
from lantern.tools import serve
from lantern.tools.run_cli import build_parser, LOADERS
from test_layering import modules

# Spellings the context rules below cannot tell apart, each with why it stays.
KNOWN = {("lantern.tools.train.demo", "torch"): "the model card reads the torch version from its metrics"}

# A runner name is also a package name (torch, onnxruntime, tensorrt) and "tensorrt" a TensorRT flavor:
# those uses are not runner names.
PACKAGE_CALLS = {"quiet", "import_module", "find_spec", "version", "importorskip"}
FLAVOR_ONLY = set(FLAVORS) - set(RUNNERS)  # tensorrt-rtx: a constant beside it is a flavor too
assert FLAVOR_ONLY


def _docstrings(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _not_a_runner(node, parents):
    """A constant spelled like a runner that names a package or a TensorRT flavor, by its context."""
    parent = parents[node]
    if isinstance(parent, ast.Compare):
        return any("flavor" in ast.unparse(x) for x in [parent.left, *parent.comparators])
    if isinstance(parent, ast.keyword):
        return parent.arg == "flavor"
    if isinstance(parent, ast.Call):
        func = parent.func
        return (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in PACKAGE_CALLS
    if isinstance(parent, ast.Dict) and node in parent.keys:
        if "version" in ast.unparse(parent.values[parent.keys.index(node)]):
            return True  # {"torch": torch.__version__}
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set, ast.Dict, ast.IfExp)):
        beside = [c.value for c in ast.walk(parent) if isinstance(c, ast.Constant)]
        if FLAVOR_ONLY & set(beside):
            return True  # ("tensorrt", "tensorrt-rtx")
        loop = parents.get(parent)
        if isinstance(loop, (ast.For, ast.comprehension)) and loop.iter is parent:
            return isinstance(loop.target, ast.Name) and loop.target.id in ("module", "package")
    return False


def spelled_runner_names(module, path):
    """(module, line, text) of every string in a source that spells a runner name (docstrings and
    comments aside): a hyphenated name anywhere in a string, the others as a whole string."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    docs = _docstrings(tree)
    hyphenated = [n for n in RUNNERS if "-" in n]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in docs:
            continue
        text = node.value
        if any(n in text for n in hyphenated) or text in RUNNERS and not _not_a_runner(node, parents):
            if (module, text) not in KNOWN:
                yield module, node.lineno, text


def scattered(sources):
    return sorted(hit for module, path in sources.items() if not module.startswith("lantern.runtime.backends")
                  for hit in spelled_runner_names(module, path))


def test_no_module_outside_the_registry_spells_a_runner_name():
    assert scattered(modules()) == []


@pytest.mark.parametrize("text, found", [
    ('def device(args):\n    return "cuda" if args.backend == "tensorrt" else "cpu"\n', True),
    ('LOADERS = ("torch", "tensorrt-torch")\n', True),
    ('def f(p):\n    p.add_argument("--backend", default="onnxruntime")\n', True),
    ('HELP = "capture on CUDA (onnxruntime-torch never)"\n', True),
    ('def f(entry):\n    return entry.backend in ("tensorrt",)\n', True),
    ('import torch\nVERSIONS = {"torch": torch.__version__}\n', False),
    ('def f(flavor):\n    return flavor == "tensorrt"\n', False),
    ('FLAVORS = ("tensorrt", "tensorrt-rtx")\n', False),
    ('def f():\n    for package in ("torch", "onnx"):\n        print(package)\n', False),
    ('"""The tensorrt-torch backend."""\n# onnxruntime-torch too\n', False),
])
def test_the_check_sees_a_spelled_name_and_not_a_package_or_flavor(tmp_path, text, found):
    sources = modules()
    path = tmp_path / "planted.py"
    path.write_text(text)
    sources["lantern.tools.planted"] = str(path)
    assert bool([h for h in scattered(sources) if h[0] == "lantern.tools.planted"]) == found


# ---------------------------------------------------------------------------------------------
# The records against what they describe


BACKEND_CLASSES = {"onnxruntime": OnnxRuntimeBackend, "tensorrt": TensorRTBackend, "torch": TorchBackend,
                   "tensorrt-torch": TensorRTTorchBackend, "onnxruntime-torch": OnnxRuntimeTorchBackend}


@pytest.mark.parametrize("name", list(RUNNERS))
def test_each_record_says_what_its_backend_does(name):
    backend, r = BACKEND_CLASSES[name], runner(name)
    options = inspect.signature(backend.__init__).parameters
    assert backend.name == name
    assert r.device == options["device"].default  # where it runs unless told: tune's clock follows it
    if r.cuda_graphs_option:
        assert "cuda_graphs" in options


def test_the_records_group_the_runners_as_the_issue_names_them():
    assert names(plans=True) == ["tensorrt", "tensorrt-torch"]
    assert names(export=True) == ["torch", "tensorrt-torch", "onnxruntime-torch"]
    assert [n for n in RUNNERS if runner(n).hybrid] == ["tensorrt-torch", "onnxruntime-torch"]
    assert [n for n in RUNNERS if runner(n).reference] == ["torch"]
    assert names(device="cuda") == ["tensorrt", "tensorrt-torch"]
    assert backends.DEFAULT == "onnxruntime" and not runner(backends.DEFAULT).export  # torch-free


def test_lantern_run_opens_every_runner_the_runtime_cannot_open_alone():
    assert set(torch_backend.OPENERS) == set(LOADERS) == set(names(export=True))
    parser = build_parser()
    for command in ("generate", "tune"):
        action = next(a for a in parser._subparsers._group_actions[0].choices[command]._actions if a.dest == "backend")
        assert list(action.choices) == list(RUNNERS) and action.default == backends.DEFAULT
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]
    assert next(a for a in serve_parser._actions if a.dest == "backend").choices == names(export=False)
    assert serve.ServeOptions().backend == backends.DEFAULT


def test_an_unknown_runner_is_one_line_naming_the_valid_ones():
    with pytest.raises(LanternError) as err:
        backends.open_backend("onnx", "engine", None)
    assert str(err.value) == f"unknown backend 'onnx'; valid: {', '.join(RUNNERS)}"
    with pytest.raises(LanternError, match="lantern.export.torch_backend.open_torch_backend"):
        backends.open_backend("torch", "engine", None)  # its modules come from lantern.export
