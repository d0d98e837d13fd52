"""The export's graph cache (lantern.export.graph_cache): a graph copied from the cache is the
file the exporter writes, the key changes with anything the file depends on, and a re-export
through the CLI takes its unchanged graphs from the cache without tracing."""
import hashlib
import json
import os

import pytest
import torch

from engines import export_like, manifest
from lantern.export import graph_cache, graph_export
from lantern.export.families import FAMILIES, LoadedModel
from lantern.runtime.contracts import resolved_io
from tiny import tiny_target


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def condition_graph(seed=0, **overrides):
    """The tiny c2i target's condition graph: its module and I/O contract."""
    family = FAMILIES["llamagen"]
    models = {"target": LoadedModel(tiny_target("c2i", seed=seed, **overrides), {})}
    family.cast(models, "fp32")
    contract, module = family.graphs(models, None, "plain")["condition"]
    dims = family.dims("condition", models, None)
    return module, resolved_io(contract, dims, "float32", layers=family.layers("condition", models))


def test_a_cached_graph_is_the_file_the_exporter_writes(tmp_path, monkeypatch):
    module, io = condition_graph()
    cache = tmp_path / "cache"
    for name in ("fresh", "stored", "copied"):
        (tmp_path / name).mkdir()
    fresh = graph_export.export_graph(module, io, str(tmp_path / "fresh" / "condition.onnx"))
    stored = graph_export.export_graph(module, io, str(tmp_path / "stored" / "condition.onnx"), cache=str(cache))
    assert fresh == stored == ["condition.onnx"] and len(os.listdir(cache)) == 1

    def no_tracing(*args, **kwargs):
        raise AssertionError("a cached graph was traced again")

    monkeypatch.setattr(torch.onnx, "export", no_tracing)
    copied = graph_export.export_graph(module, io, str(tmp_path / "copied" / "condition.onnx"), cache=str(cache))
    assert copied == ["condition.onnx"]
    assert digest(tmp_path / "fresh" / "condition.onnx") == digest(tmp_path / "stored" / "condition.onnx") == \
        digest(tmp_path / "copied" / "condition.onnx")
    # an entry being written (a temporary directory) or one already there is never half-read or replaced
    graph_cache.store_graph(str(cache), os.listdir(cache)[0], str(tmp_path / "fresh" / "condition.onnx"),
                            ["condition.onnx"])
    assert len(os.listdir(cache)) == 1
    # a link planted in the cache (an entry, or a file in one, pointing elsewhere) is a miss: traced again
    monkeypatch.undo()
    key = os.listdir(cache)[0]
    elsewhere = tmp_path / "elsewhere"
    os.rename(cache / key, elsewhere)
    os.symlink(elsewhere, cache / key)
    assert graph_cache.fetch_graph(str(cache), key, str(tmp_path / "copied" / "condition.onnx")) is None
    os.unlink(cache / key)
    (cache / key).mkdir()
    os.symlink(elsewhere / "condition.onnx", cache / key / "condition.onnx")
    assert graph_cache.fetch_graph(str(cache), key, str(tmp_path / "copied" / "condition.onnx")) is None


def test_the_key_follows_what_the_graph_is_exported_from():
    module, io = condition_graph()

    def key(m=module, spec=io, name="condition.onnx", opset=18, external=False):
        return graph_cache.graph_key(m, spec, name, opset, external)

    base = key()
    assert base == key(condition_graph()[0])  # the same weights and config rebuilt
    assert base != key(condition_graph(seed=1)[0])  # other weights
    with torch.no_grad():
        nudged, _ = condition_graph()
        next(nudged.parameters()).view(-1)[0] += 1e-6
    assert base != key(nudged)
    assert base != key(condition_graph(num_classes=11)[0])  # another config (and table size)
    other_io = json.loads(json.dumps(io))
    next(iter(other_io["inputs"].values()))["dtype"] = "int32"
    assert base != key(spec=other_io)
    assert base != key(name="other.onnx") and base != key(opset=19) and base != key(external=True)
    # what the key cannot describe is exported without the cache
    hooked, _ = condition_graph()
    hooked.register_forward_hook(lambda m, i, o: o)
    assert key(hooked) is None
    with_function, _ = condition_graph()
    with_function.scale = lambda x: x
    assert key(with_function) is None


def test_a_reexport_with_another_tree_takes_its_graphs_from_the_cache(c2i_engine, graph_cache, tmp_path,
                                                                      monkeypatch):
    """The session's cache (conftest: $LANTERN_GRAPH_CACHE, the CLI's default) holds the session
    engine's graphs, so exporting its checkpoints with another tree traces nothing."""
    assert os.environ["LANTERN_GRAPH_CACHE"] == str(graph_cache)

    def no_tracing(*args, **kwargs):
        raise AssertionError("an unchanged graph was traced again")

    monkeypatch.setattr(torch.onnx, "export", no_tracing)
    out = export_like(c2i_engine, tmp_path / "other-tree", "--tree", "naive_extend_57")
    assert manifest(out)["tree"]["name"] == "naive_extend_57" != manifest(c2i_engine)["tree"]["name"]
    for name, entry in manifest(c2i_engine)["graphs"].items():
        assert digest(os.path.join(out, entry["file"])) == digest(os.path.join(c2i_engine, entry["file"])), name


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("/some/cache", "/some/cache")])
def test_the_option_defaults_to_the_variable(value, expected, monkeypatch):
    from lantern.export import cli

    if value is None:
        monkeypatch.delenv("LANTERN_GRAPH_CACHE", raising=False)
    else:
        monkeypatch.setenv("LANTERN_GRAPH_CACHE", value)
    argv = ["onnx", "--target", "t.pt", "--out", "e"]
    assert cli.build_parser().parse_args(argv).graph_cache == expected
    assert cli.build_parser().parse_args(argv + ["--graph-cache", "d"]).graph_cache == "d"
    assert cli.build_parser().parse_args(argv + ["--no-graph-cache"]).graph_cache is None
