"""`lantern-run generate` with damaged engines and reused, shared or odd --out directories, on
the demo's engine (lantern.runtime.outdir.OutputDirectory, integrity.verify_files,
integrity.load_neighbors)."""
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


def generate(engine, out, *extra, classes="0,1,2"):
    return run_cli.main(["generate", str(engine), "--mode", "exact", "--greedy", "--classes", classes,
                         "--threads", "1", "--out", str(out), *extra])


def one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lantern-run: error: "), err
    return err[0]


def test_a_reused_out_holds_exactly_the_new_run(demo_engine, tmp_path, capsys):
    out = tmp_path / "out"
    assert generate(demo_engine, out, classes="0,1,2") == 0
    assert generate(demo_engine, out, classes="4") == 2
    assert "already exists; pass --force" in one_line(capsys)
    assert generate(demo_engine, out, "--force", classes="4") == 0
    assert sorted(os.listdir(out)) == ["image_000.png", "stats.json", "tokens.npy"]  # no stale images
    assert np.load(out / "tokens.npy").shape[0] == 1
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_output_modes_follow_the_umask(demo_engine, tmp_path):
    old = os.umask(0o022)
    try:
        assert generate(demo_engine, tmp_path / "out", classes="0") == 0
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE(os.stat(tmp_path / "out" / n).st_mode) for n in os.listdir(tmp_path / "out")}
    assert modes == {"image_000.png": 0o644, "stats.json": 0o644, "tokens.npy": 0o644}


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


def test_a_flipped_byte_of_the_same_size_is_refused(demo_engine, tmp_path, capsys):
    engine = tmp_path / "engine"
    shutil.copytree(demo_engine, engine)
    data = bytearray((engine / "target.onnx").read_bytes())
    data[len(data) // 2] ^= 0x10
    (engine / "target.onnx").write_bytes(bytes(data))
    assert generate(engine, tmp_path / "out") == 2
    assert "target.onnx does not match its sha256" in one_line(capsys)
    assert not (tmp_path / "out").exists()


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
    assert "damaged neighbor table" in one_line(capsys)
