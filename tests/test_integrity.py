"""Engine integrity (lantern.runtime.integrity): content hashes with remembered file versions,
and .npy tables read without trusting their headers."""
import hashlib
import io
import json
import os
import shutil

import numpy as np
import pytest

from lantern.export import cli as export_cli
from lantern.runtime import integrity
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.integrity import HashCache, load_neighbors, read_npy, verify_files


@pytest.fixture
def engine(tmp_path):
    """A directory of files and the manifest-style record of them (hashes computed here, with
    hashlib directly, not with the code under test)."""
    d = tmp_path / "engine"
    d.mkdir()
    rng = np.random.default_rng(0)
    contents = {"target.onnx": rng.bytes(300_000), "target.onnx.data": rng.bytes(5_000_000), "tiny.onnx": b"x"}
    for name, data in contents.items():
        (d / name).write_bytes(data)
    files = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in contents.items()}
    return d, files


@pytest.fixture
def hashes(monkeypatch):
    """Count the files actually hashed."""
    seen = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda path: seen.append(os.path.basename(path)) or real(path))
    return seen


def flip_keeping_mtime(path, offset=-1):
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only content differs


def test_each_file_version_is_hashed_once(engine, tmp_path, hashes):
    d, files = engine
    cache = tmp_path / "cache" / "verified.json"
    verify_files(d, files, cache=cache)
    assert sorted(hashes) == sorted(files)
    verify_files(d, files, cache=cache)
    assert len(hashes) == len(files)  # the later open hashed nothing
    flip_keeping_mtime(d / "target.onnx.data")
    with pytest.raises(LanternError, match="target.onnx.data does not match its sha256.*rebuild the engine"):
        verify_files(d, files, cache=cache)
    assert hashes[len(files):] == ["target.onnx.data"]  # only the changed file again


def test_a_wrong_hash_in_the_manifest_is_caught_on_cached_opens_too(engine, tmp_path):
    d, files = engine
    cache = tmp_path / "verified.json"
    verify_files(d, files, cache=cache)
    files["tiny.onnx"]["sha256"] = "0" * 64
    with pytest.raises(LanternError, match="tiny.onnx does not match its sha256"):
        verify_files(d, files, cache=cache)


def test_without_a_cache_every_open_hashes(engine, hashes):
    d, files = engine
    verify_files(d, files, cache=None)
    verify_files(d, files, cache=None)
    assert len(hashes) == 2 * len(files)


def test_an_unusable_cache_only_costs_time(engine, tmp_path):
    d, files = engine
    (tmp_path / "file").write_text("")
    verify_files(d, files, cache=tmp_path / "file" / "verified.json")  # cannot be created
    (tmp_path / "garbage.json").write_text("{not json")
    verify_files(d, files, cache=tmp_path / "garbage.json")
    assert len(HashCache(tmp_path / "garbage.json").entries) == len(files)  # rewritten whole


def test_the_default_cache_lives_in_the_user_cache_directory(engine, tmp_path, monkeypatch):
    d, files = engine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    verify_files(d, files)
    assert len(json.loads((tmp_path / "xdg" / "lantern" / "verified-files.json").read_text())) == len(files)


def test_a_file_changed_between_its_stat_and_its_hash_is_not_remembered(engine, tmp_path, monkeypatch):
    """verify_files stats every file before it hashes any. A file a writer rewrites in that window
    is hashed as it is now: its digest must not be remembered under the version the stat saw
    (that pair would describe neither file), and it is refused when it no longer matches."""
    d, files = engine
    real = integrity.sha256_file

    def writer_at_work(path):
        if os.path.basename(path) == "target.onnx":  # hashed before tiny.onnx (sorted order)
            st = os.stat(d / "tiny.onnx")
            (d / "tiny.onnx").write_bytes(b"y")  # same size
            # a later mtime: the version differs even where timestamps are coarser than this test
            os.utime(d / "tiny.onnx", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return real(path)

    monkeypatch.setattr(integrity, "sha256_file", writer_at_work)
    cache = tmp_path / "verified.json"
    with pytest.raises(LanternError, match="tiny.onnx does not match its sha256"):
        verify_files(d, files, cache=cache)
    remembered = sorted(digest for digest, _ in json.loads(cache.read_text()).values())
    assert remembered == sorted(files[name]["sha256"] for name in ("target.onnx", "target.onnx.data"))


@pytest.mark.parametrize("case", ["missing", "truncated", "directory", "no_files", "null_entry", "bad_hash",
                                  "escape", "bool_size"])
def test_damage_and_bad_records_are_one_line(engine, tmp_path, case):
    d, files = engine
    message = {"missing": "tiny.onnx is missing", "truncated": "has 299999 bytes, the manifest says 300000",
               "directory": "not a regular file", "no_files": "lists no files", "null_entry": "not a {size, sha256}",
               "bad_hash": "no valid sha256", "escape": "outside the engine directory",
               "bool_size": "no valid size"}[case]
    if case == "missing":
        os.remove(d / "tiny.onnx")
    elif case == "truncated":
        (d / "target.onnx").write_bytes((d / "target.onnx").read_bytes()[:-1])
    elif case == "directory":
        os.remove(d / "tiny.onnx")
        (d / "tiny.onnx").mkdir()
    elif case == "no_files":
        files = None
    elif case == "null_entry":
        files["tiny.onnx"] = None
    elif case == "bad_hash":
        files["tiny.onnx"]["sha256"] = "abc"
    elif case == "escape":
        files["../outside"] = files.pop("tiny.onnx")
    else:
        files["tiny.onnx"]["size"] = True
    with pytest.raises(LanternError, match=message) as e:
        verify_files(d, files, cache=None)
    assert "\n" not in str(e.value) and "rebuild" in str(e.value)


# ---------------------------------------------------------------------------------------------
# .npy tables


def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return bytearray(buffer.getvalue())


def neighbor_table(n=64, k=10):
    return np.array([[(i + 1 + j) % n for j in range(k)] for i in range(n)], dtype=np.uint8)


def test_a_good_table_loads(tmp_path):
    np.save(tmp_path / "nn.npy", neighbor_table())
    assert (load_neighbors(tmp_path / "nn.npy", vocab_size=64, k=10) == neighbor_table()).all()


def damaged_headers():
    """Header damage that numpy's own np.load lets escape as tokenize.TokenError or trusts."""
    good = npy_bytes(neighbor_table())
    cases = {}
    for name, (offset, value) in {"quote": (10, ord('"')), "key": (12, ord('"')), "brace": (10, ord("(")), "magic": (1, 0),
                                  "version": (6, 9), "length": (8, 0xFF)}.items():
        data = bytearray(good)
        data[offset] = value
        cases[name] = bytes(data)
    text = bytes(good)
    cases["huge_shape"] = text.replace(b"'shape': (64, 10), }", b"'shape': (10**12,),}")
    cases["objects"] = text.replace(b"'|u1'", b"'|O' ")
    cases["truncated"] = text[:-5]
    cases["empty"] = b""
    return cases


@pytest.mark.parametrize("case", sorted(damaged_headers()))
def test_a_damaged_npy_is_one_line(tmp_path, case):
    path = tmp_path / "nn.npy"
    path.write_bytes(damaged_headers()[case])
    with pytest.raises(LanternError) as e:
        read_npy(path, "neighbor table")
    assert "\n" not in str(e.value) and str(path) in str(e.value), str(e.value)


def test_numpy_alone_lets_a_damaged_header_escape(tmp_path):
    """Why read_npy exists: np.load raises something other than ValueError for a damaged header."""
    path = tmp_path / "nn.npy"
    path.write_bytes(damaged_headers()["quote"])
    with pytest.raises(Exception) as e:
        np.load(path, allow_pickle=False)
    assert not isinstance(e.value, (ValueError, OSError)), type(e.value)


@pytest.mark.parametrize("table,vocab,message", [
    (neighbor_table().astype(np.float32), 64, "unsigned integer"),
    (neighbor_table()[:, :0], 64, "k >= 1"),
    (neighbor_table()[0], 64, "expected \\[codes, k >= 1\\]"),
    (neighbor_table(), 128, "64 rows but the vocabulary has 128"),
    (np.full((64, 10), 64, dtype=np.uint8), 64, "outside the 64 codes"),
    (np.zeros((64, 10), dtype=np.uint8), 64, "lists itself"),
])
def test_a_wrong_table_is_refused(tmp_path, table, vocab, message):
    np.save(tmp_path / "nn.npy", table)
    with pytest.raises(LanternError, match=message):
        load_neighbors(tmp_path / "nn.npy", vocab_size=vocab)


def test_an_engine_whose_neighbor_table_has_another_k_than_its_manifest_is_refused(c2i_engine, tmp_path):
    """A table that is sound on its own and listed with its true size and sha256, but narrower
    than the manifest's k (which relaxed modes draft with): refused when the engine opens."""
    d = shutil.copytree(c2i_engine, tmp_path / "engine")
    manifest = json.loads((d / "manifest.json").read_text())
    k = manifest["neighbors"]["k"]
    path = d / manifest["neighbors"]["file"]
    np.save(path, np.load(path)[:, :k - 1])
    data = path.read_bytes()
    manifest["files"][manifest["neighbors"]["file"]] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LanternError) as e:
        Engine(d, threads=1)
    assert f"neighbor table has k = {k - 1}, the manifest says {k}" in str(e.value) and "\n" not in str(e.value)


def test_neighbors_cli_with_a_damaged_codebook_is_one_line(tmp_path, capsys):
    (tmp_path / "codes.npy").write_bytes(damaged_headers()["quote"])
    assert export_cli.main(["neighbors", str(tmp_path / "codes.npy"), "-o", str(tmp_path / "nn.npy")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "damaged codebook" in err[0], err
    assert not (tmp_path / "nn.npy").exists()
