"""`lantern-run generate` with damaged engines and reused, shared or odd --out directories, on
the demo's engine. Each test runs once its piece is wired into runtime/cli.py / the manifest
reader (issue 12: lantern.runtime.outdir.OutputDirectory, integrity.verify_files,
integrity.load_neighbors); until then it skips, saying which."""
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from lantern.tools import run_cli


def _generate_has_force():
    parser = run_cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return any("--force" in a.option_strings for a in sub.choices["generate"]._actions)


outputs_wired = pytest.mark.skipif(not _generate_has_force(), reason="runtime/cli.py generate does not use "
                                   "lantern.runtime.outdir.OutputDirectory (--force) yet")


def _reader_verifies_hashes():
    import inspect

    from lantern.runtime import generator, manifest
    return "verify_files" in inspect.getsource(manifest) + inspect.getsource(generator)


def _generator_loads_neighbors():
    import inspect

    from lantern.runtime import generator
    return "load_neighbors" in inspect.getsource(generator)


hashes_wired = pytest.mark.skipif(not _reader_verifies_hashes(), reason="the manifest reader does not call "
                                  "lantern.runtime.integrity.verify_files yet")
neighbors_wired = pytest.mark.skipif(not _generator_loads_neighbors(), reason="the generator does not load "
                                     "neighbors.npy with lantern.runtime.integrity.load_neighbors yet")


def generate(engine, out, *extra, classes="0,1,2"):
    return run_cli.main(["generate", str(engine), "--mode", "exact", "--greedy", "--classes", classes,
                         "--threads", "1", "--out", str(out), *extra])


def one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lantern-run: error: "), err
    return err[0]


@outputs_wired
def test_a_reused_out_holds_exactly_the_new_run(demo_engine, tmp_path, capsys):
    out = tmp_path / "out"
    assert generate(demo_engine, out, classes="0,1,2") == 0
    assert generate(demo_engine, out, classes="4") == 2
    assert "already exists; pass --force" in one_line(capsys)
    assert generate(demo_engine, out, "--force", classes="4") == 0
    assert sorted(os.listdir(out)) == ["image_000.png", "stats.json", "tokens.npy"]  # no stale images
    assert np.load(out / "tokens.npy").shape[0] == 1
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


@outputs_wired
def test_output_modes_follow_the_umask(demo_engine, tmp_path):
    old = os.umask(0o022)
    try:
        assert generate(demo_engine, tmp_path / "out", classes="0") == 0
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE(os.stat(tmp_path / "out" / n).st_mode) for n in os.listdir(tmp_path / "out")}
    assert modes == {"image_000.png": 0o644, "stats.json": 0o644, "tokens.npy": 0o644}


@outputs_wired
@pytest.mark.parametrize("case", ["file", "under_file", "foreign"])
def test_odd_outs_are_one_line(demo_engine, tmp_path, capsys, case):
    (tmp_path / "f").write_text("keep")
    out = {"file": tmp_path / "f", "under_file": tmp_path / "f" / "out", "foreign": tmp_path / "mine"}[case]
    if case == "foreign":
        out.mkdir()
        (out / "notes.txt").write_text("keep")
    assert generate(demo_engine, out, "--force") == 2
    assert {"file": "is a file", "under_file": "is a file, not a directory",
            "foreign": "it holds 'notes.txt'"}[case] in one_line(capsys)
    assert (tmp_path / "f").read_text() == "keep"


@outputs_wired
def test_concurrent_runs_never_mix(demo_engine, tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from lantern.tools import run_cli
        sys.exit(run_cli.main(["generate", {str(demo_engine)!r}, "--mode", "exact", "--greedy", "--classes",
                               sys.argv[1], "--threads", "1", "--out", {str(tmp_path / 'out')!r}]))
    """)
    runs = [subprocess.Popen([sys.executable, "-c", code, classes], stderr=subprocess.PIPE, text=True)
            for classes in ("0,1,2,3", "5")]
    results = [(r.wait(120), r.stderr.read()) for r in runs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    rows = np.load(tmp_path / "out" / "tokens.npy").shape[0]
    images = sorted(n for n in os.listdir(tmp_path / "out") if n.endswith(".png"))
    assert len(images) == rows and rows in (4, 1)  # one run's outputs, whole


@hashes_wired
def test_a_flipped_byte_of_the_same_size_is_refused(demo_engine, tmp_path, capsys):
    engine = tmp_path / "engine"
    shutil.copytree(demo_engine, engine)
    data = bytearray((engine / "target.onnx").read_bytes())
    data[len(data) // 2] ^= 0x10
    (engine / "target.onnx").write_bytes(bytes(data))
    assert generate(engine, tmp_path / "out") == 2
    assert "target.onnx does not match its sha256" in one_line(capsys)
    assert not (tmp_path / "out").exists()


@neighbors_wired
def test_a_corrupted_neighbor_table_is_one_line(demo_engine, tmp_path, capsys):
    engine = tmp_path / "engine"
    shutil.copytree(demo_engine, engine)
    manifest = json.loads((engine / "manifest.json").read_text())
    data = bytearray((engine / "neighbors.npy").read_bytes())
    data[10] = ord('"')  # numpy's own parser lets this escape as tokenize.TokenError
    (engine / "neighbors.npy").write_bytes(bytes(data))
    manifest["files"]["neighbors.npy"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (engine / "manifest.json").write_text(json.dumps(manifest))  # a table damaged before its hash was taken
    assert run_cli.main(["generate", str(engine), "--mode", "lantern++", "--classes", "0", "--threads", "1",
                         "--out", str(tmp_path / "out")]) == 2
    assert "damaged neighbour table" in one_line(capsys)
