"""`lantern-export onnx --out`: atomic placement of the engine directory, with real processes
exporting, racing and being killed. The ONNX export itself is replaced by empty files (these
tests are about the directory); test_export.py covers the graphs."""
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from tiny import tiny_target

from lantern.export import checkpoints, cli, onnx_export

# An export in a child process whose graph export blocks until a release file appears.
CHILD = textwrap.dedent(r"""
    import os, sys, time
    from lantern.export import cli, onnx_export
    release = sys.argv[1]
    def blocking(module, io_spec, path, opset=18, deferred=None, cache=None):
        open(path, "wb").close()
        print("exporting", flush=True)
        while not os.path.exists(release):
            time.sleep(0.01)
        return [os.path.basename(path)]
    onnx_export.export_graph = blocking
    sys.exit(cli.main(sys.argv[2:]))
""")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    model = tiny_target("c2i", seed=0)
    a = model.args
    config = root / "c2i.json"
    config.write_text(json.dumps({"dim": a.dim, "n_layer": a.n_layer, "n_head": a.n_head, "vocab_size": a.vocab_size,
                                  "num_classes": a.num_classes, "block_size": a.block_size,
                                  "multiple_of": a.multiple_of, "cls_token_num": 1, "model_type": "c2i"}))
    checkpoints.save_llamagen_pt(model, root / "c2i.pt")
    return ["--target", str(root / "c2i.pt"), "--config", str(config)]


@pytest.fixture
def empty_graphs(monkeypatch):
    def empty(module, io_spec, path, opset=18, deferred=None, cache=None):
        open(path, "wb").close()
        return [os.path.basename(path)]

    monkeypatch.setattr(onnx_export, "export_graph", empty)


def export(target, out, *extra):
    return cli.main(["onnx", *target, "--out", str(out), "--no-progress", *extra])


def hidden(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith("."))


def one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lantern-export: error: "), err
    return err[0]


def test_a_folder_that_appears_at_out_during_the_export_is_kept(target, tmp_path, monkeypatch, capsys):
    out = tmp_path / "engine"

    def meanwhile(module, io_spec, path, opset=18, deferred=None, cache=None):
        if not out.exists():  # a user's folder appears at --out while the graphs are exported
            out.mkdir()
            (out / "precious.txt").write_text("keep")
        open(path, "wb").close()
        return [os.path.basename(path)]

    monkeypatch.setattr(onnx_export, "export_graph", meanwhile)
    assert export(target, out, "--force") == 2  # not even --force replaces what the run did not find
    line = one_line(capsys)
    assert "did not create was put there" in line
    assert os.listdir(out) == ["precious.txt"] and (out / "precious.txt").read_text() == "keep"
    kept = tmp_path / f"engine.unplaced-{os.getpid()}"
    assert str(kept) in line and (kept / "manifest.json").is_file()
    assert hidden(tmp_path) == []


def test_an_engine_is_replaced_only_with_force_and_a_directory_never(target, tmp_path, empty_graphs, capsys):
    out = tmp_path / "engine"
    assert export(target, out) == 0
    first = json.loads((out / "manifest.json").read_text())["build"]["created"]
    assert export(target, out) == 2 and "already exists; pass --force" in one_line(capsys)
    assert export(target, out, "--force") == 0
    assert json.loads((out / "manifest.json").read_text())["build"]["created"] >= first
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    assert export(target, other, "--force") == 2 and "not an engine directory" in one_line(capsys)
    (tmp_path / "file").write_text("keep")
    assert export(target, tmp_path / "file", "--force") == 2 and "is a file" in one_line(capsys)
    assert export(target, tmp_path / "file" / "engine") == 2 and "is a file, not a directory" in one_line(capsys)
    assert (other / "notes.txt").read_text() == "keep" and (tmp_path / "file").read_text() == "keep"
    assert hidden(tmp_path) == []


def test_engine_modes_follow_the_umask(target, tmp_path, empty_graphs):
    old = os.umask(0o027)
    try:
        assert export(target, tmp_path / "engine") == 0
    finally:
        os.umask(old)
    mode = lambda path: stat.S_IMODE(os.stat(path).st_mode)  # noqa: E731
    assert mode(tmp_path / "engine") == 0o750  # tempfile.mkdtemp would make it 0700
    assert {mode(tmp_path / "engine" / n) for n in os.listdir(tmp_path / "engine")} == {0o640}


def test_concurrent_exports_one_wins_and_killed_exports_are_cleaned(target, tmp_path, empty_graphs, capsys):
    out = tmp_path / "engine"
    release = tmp_path / "release"

    def start():
        return subprocess.Popen([sys.executable, "-c", CHILD, str(release), "onnx", *target, "--out", str(out),
                                 "--no-progress", "--force"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # 1. A second export to the same --out fails at once, naming the first.
    first = start()
    assert first.stdout.readline().strip() == "exporting"
    assert export(target, out, "--force") == 2
    assert f"another run (pid {first.pid}) is writing it" in one_line(capsys)
    # 2. SIGKILL: the staging directory and the lock stay behind ...
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    assert any(n.startswith(".engine.tmp-") for n in hidden(tmp_path)) and ".engine.lock" in hidden(tmp_path)
    # ... until the next export to that --out removes them.
    assert export(target, out) == 0
    assert "left by an interrupted run" in capsys.readouterr().err
    assert hidden(tmp_path) == [] and (out / "manifest.json").is_file()
    # 3. SIGTERM: the export removes its own staging directory and exits 143.
    second = start()
    assert second.stdout.readline().strip() == "exporting"
    second.send_signal(signal.SIGTERM)
    assert second.wait(30) == 143
    assert "terminated" in second.stderr.read()
    assert hidden(tmp_path) == [] and (out / "manifest.json").is_file()
    # 4. Released, an export runs to the end and replaces the engine (it had --force).
    release.touch()
    third = start()
    assert third.wait(60) == 0, third.stderr.read()
    assert hidden(tmp_path) == []
