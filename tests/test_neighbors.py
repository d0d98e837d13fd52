"""Codebook neighbors: agreement with a brute-force full distance matrix, exact tie order, dtype
choice, and the `lantern-export neighbors` command (output written atomically, one-line errors)."""
import numpy as np
import pytest
import torch

from lantern.export import cli, neighbors, vq
from lantern.export.neighbors import nearest_neighbors
from lantern.runtime.errors import LanternError


def brute_force(x, k=None):
    """Full float64 distance matrix, self pushed to the end, rows ordered by (distance, index)."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    dist = np.sqrt(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))
    np.fill_diagonal(dist, np.inf)
    index = np.broadcast_to(np.arange(n), (n, n))
    order = np.lexsort((index, dist), axis=-1)  # last key is primary: distance, then index
    return order[:, : (n - 1 if k is None else k)]


def unit_rows(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("k", [None, 1, 7])
def test_normalised_codebook_matches_brute_force(k):
    x = unit_rows(np.random.default_rng(0).standard_normal((300, 8))).astype(np.float32)
    got = nearest_neighbors(x, k=k)
    assert got.dtype == np.uint16  # 300 codes: indices up to 299 need 16 bits
    assert got.shape == (300, 299 if k is None else k)
    assert (got == brute_force(x, k)).all()


def test_raw_codebook_matches_brute_force_and_differs_from_normalised():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((200, 8)) * rng.uniform(0.2, 3.0, size=(200, 1))
    got = nearest_neighbors(x)
    assert got.dtype == np.uint8 and got.shape == (200, 199)
    assert (got == brute_force(x)).all()
    assert (got != nearest_neighbors(unit_rows(x))).any()  # raw vs normalised orders differ


def test_ties_go_to_the_lower_index():
    # Integer lattice points with duplicates: almost every distance is tied with others.
    rng = np.random.default_rng(2)
    x = rng.integers(-2, 3, size=(120, 2)).astype(np.float64)
    got = nearest_neighbors(x)
    assert (got == brute_force(x)).all()
    for i in range(len(x)):
        assert i not in got[i]
        dup = [j for j in range(len(x)) if j != i and (x[j] == x[i]).all()]
        assert list(got[i, : len(dup)]) == dup  # exact duplicates first, in index order


def test_chunks_and_threads_agree():
    x = np.random.default_rng(3).standard_normal((700, 4))  # several CHUNK_ROWS chunks
    one = nearest_neighbors(x, threads=1)
    assert (one == nearest_neighbors(x, threads=2)).all()
    assert (one == brute_force(x)).all()


def test_index_dtype():
    assert neighbors.index_dtype(2) == np.uint8
    assert neighbors.index_dtype(256) == np.uint8
    assert neighbors.index_dtype(257) == np.uint16
    assert neighbors.index_dtype(65536) == np.uint16
    assert neighbors.index_dtype(65537) == np.uint32
    assert nearest_neighbors(np.random.default_rng(4).standard_normal((257, 2)), k=3).dtype == np.uint16


@pytest.mark.parametrize("vectors, k, match", [
    (np.zeros(8), None, "2-D"),
    (np.zeros((4, 2, 2)), None, "2-D"),
    (np.zeros((1, 8)), None, "at least 2 codes"),
    (np.eye(4), 0, r"k must be .* \[1, 3\]"),
    (np.eye(4), 4, r"k must be .* \[1, 3\]"),
    (np.eye(4), 1.5, "k must be"),
    (np.array([[0.0, 1.0], [np.nan, 0.0], [1.0, 1.0]]), None, "non-finite.*code 1"),
    (np.array([[0.0, 1.0], [0.0, np.inf]]), None, "non-finite"),
    (np.array([[1j, 0], [0, 1j]]), None, "real numbers"),
])
def test_bad_input(vectors, k, match):
    with pytest.raises(LanternError, match=match):
        nearest_neighbors(vectors, k=k)


# ----------------------------------------------------------------------------- command line

def run_cli(capsys, *argv):
    rc = cli.main(["neighbors", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def only(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir())


def test_cli_npy(tmp_path, capsys):
    x = np.random.default_rng(5).standard_normal((50, 3)).astype(np.float32)
    np.save(tmp_path / "book.npy", x)
    rc, out, err = run_cli(capsys, tmp_path / "book.npy", "-o", tmp_path / "nn.npy", "--k", 10)
    assert rc == 0 and err == ""
    assert "N=50" in out and "D=3" in out and "k=10" in out and "uint8" in out
    table = np.load(tmp_path / "nn.npy")
    assert table.dtype == np.uint8 and (table == brute_force(x, 10)).all()
    assert only(tmp_path) == ["book.npy", "nn.npy"]

    rc, _, _ = run_cli(capsys, tmp_path / "book.npy", "-o", tmp_path / "unit.npy", "--normalize")
    assert rc == 0 and (np.load(tmp_path / "unit.npy") == brute_force(unit_rows(x.astype(np.float64)))).all()


def test_cli_checkpoint_default_and_raw(tmp_path, capsys):
    torch.manual_seed(0)
    model = vq.VQModel(vq.VQConfig(codebook_size=300, z_channels=16, ch=32, encoder_ch_mult=(1, 2),
                                   decoder_ch_mult=(1, 2), num_res_blocks=1))
    with torch.no_grad():  # rows of unequal norm, as in a trained codebook
        model.quantize.embedding.weight.mul_(torch.rand(300, 1) * 3 + 0.2)
    vq.save_vq(model, tmp_path / "vq.pt")
    raw = model.quantize.embedding.weight.detach().numpy()

    rc, out, _ = run_cli(capsys, tmp_path / "vq.pt", "-o", tmp_path / "dec.npy")
    assert rc == 0 and "L2-normalised" in out
    decoded = np.load(tmp_path / "dec.npy")
    assert decoded.dtype == np.uint16 and decoded.shape == (300, 299)
    assert (decoded == brute_force(unit_rows(raw.astype(np.float64)))).all()

    rc, out, _ = run_cli(capsys, tmp_path / "vq.pt", "-o", tmp_path / "raw.npy", "--raw")
    assert rc == 0 and "raw" in out
    table = np.load(tmp_path / "raw.npy")
    # The public LANTERN recipe: cdist on the stored weights, diagonal at +inf, topk smallest.
    w = torch.from_numpy(raw).double()
    dist = torch.cdist(w, w).fill_diagonal_(float("inf"))
    lantern = torch.topk(dist, 299, dim=-1, largest=False).indices.numpy()
    assert (table == lantern).all()
    assert (table != decoded).any()


def assert_one_line_error(rc, err, match):
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lantern-export: error:") and match in lines[0], err


@pytest.mark.parametrize("case", ["missing", "rank", "k", "nan", "truncated", "not-npy", "raw-npy", "no-dir"])
def test_cli_bad_input_leaves_nothing(tmp_path, capsys, case):
    out = tmp_path / "nn.npy"
    src = tmp_path / "book.npy"
    extra = []
    if case == "missing":
        src, match = tmp_path / "absent.npy", "no such file"
    elif case == "rank":
        np.save(src, np.zeros((4, 2, 2)))
        match = "2-D"
    elif case == "k":
        np.save(src, np.eye(5))
        extra, match = ["--k", "5"], "k must be"
    elif case == "nan":
        np.save(src, np.array([[0.0, 1.0], [np.nan, 1.0]]))
        match = "non-finite"
    elif case == "truncated":
        src = tmp_path / "vq.pt"
        vq.save_vq(vq.VQModel(vq.VQConfig(codebook_size=16, z_channels=8, ch=32, encoder_ch_mult=(1,),
                                          decoder_ch_mult=(1,), num_res_blocks=1)), src)
        data = src.read_bytes()
        src.write_bytes(data[: len(data) // 2])
        match = "truncated"
    elif case == "not-npy":
        src.write_bytes(b"garbage")
        match = "not an .npy file"
    elif case == "raw-npy":
        np.save(src, np.eye(5))
        extra, match = ["--raw"], "--raw"
    elif case == "no-dir":
        np.save(src, np.eye(5))
        out, match = tmp_path / "nowhere" / "nn.npy", "does not exist"
    before = only(tmp_path)
    rc, _, err = run_cli(capsys, src, "-o", out, *extra)
    assert_one_line_error(rc, err, match)
    assert only(tmp_path) == before  # no output, no temporary file


def test_cli_error_keeps_previous_output(tmp_path, capsys):
    np.save(tmp_path / "nn.npy", np.arange(3))
    np.save(tmp_path / "book.npy", np.eye(5))
    rc, _, err = run_cli(capsys, tmp_path / "book.npy", "-o", tmp_path / "nn.npy", "--k", "9")
    assert_one_line_error(rc, err, "k must be")
    assert (np.load(tmp_path / "nn.npy") == np.arange(3)).all()
