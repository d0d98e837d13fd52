"""Latent neighbors of a VQ codebook: for every code, the other codes ordered by L2 distance.

LANTERN relaxes acceptance over a draft token's nearest codes, so the runtime needs, for each code,
the indices of the K nearest other codes, nearest first. The public LANTERN code
(entrypoints/generate_codebook.py) stores all of them (K = N - 1, 16383 per code for LlamaGen) as
uint16, computed with torch.cdist + topk on the stored codebook weights.

What this module does differently, on purpose:
- Ordering is deterministic: distances are computed in float64 as sum_d (x_i[d] - x_j[d])^2, which
  gives bit-identical values for equal true distances (d(i, j) == d(j, i), duplicates tie exactly),
  and each row is sorted with a stable sort, so ties go to the lower index. torch.topk makes no
  such promise.
- By default the vectors are the ones the decoder consumes, i.e. L2-normalised rows for LlamaGen's
  normalised codebook: "visually interchangeable" is a property of what gets decoded. `--raw`
  reproduces the public code's table (raw `quantize.embedding.weight`); the two orders differ
  whenever the stored rows do not all have the same norm.
"""
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lantern.runtime.errors import LanternError
from lantern.runtime.integrity import read_npy
from lantern.runtime.outdir import write_file

# Rows per work item. 256 rows x 16384 codes x 8 bytes is 32 MiB of distances (plus as much for
# the sort's indices and a scratch array), per thread.
CHUNK_ROWS = 256


def index_dtype(n):
    """Smallest unsigned integer dtype that holds the indices 0..n-1."""
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        if n - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)


def usable_cpus():
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def nearest_neighbors(vectors, k=None, threads=None):
    """For each of the N rows of `vectors` [N, D], the indices of its k nearest other rows by L2
    distance, nearest first; itself excluded, ties broken by lower index.

    k defaults to N - 1 (the full order). Returns an [N, k] array of the smallest unsigned integer
    dtype that holds N - 1 (uint8 up to 256 codes, uint16 up to 65536, then uint32).
    Work is split in row chunks over `threads` threads (default: the CPUs this process may use);
    numpy releases the GIL in the arithmetic and the sort.
    """
    x = np.asarray(vectors)
    if x.ndim != 2:
        raise LanternError(f"codebook must be a 2-D array [codes, dim], got shape {list(x.shape)}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise LanternError(f"codebook must hold real numbers, got dtype {x.dtype}")
    n, d = x.shape
    if n < 2 or d < 1:
        raise LanternError(f"codebook needs at least 2 codes of dimension >= 1, got shape {list(x.shape)}")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        bad = int(np.argwhere(~np.isfinite(x))[0][0])
        raise LanternError(f"codebook has non-finite values (first at code {bad})")
    k = n - 1 if k is None else k
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n - 1:
        raise LanternError(f"k must be an integer in [1, {n - 1}] for {n} codes, got {k!r}")

    out = np.empty((n, k), dtype=index_dtype(n))
    columns = np.ascontiguousarray(x.T)  # [D, N]: each coordinate of all codes, contiguous

    def chunk(start):
        stop = min(start + CHUNK_ROWS, n)
        rows = np.arange(start, stop)
        dist = np.zeros((stop - start, n))
        scratch = np.empty_like(dist)
        for j in range(d):  # same summation order for every pair: exact, symmetric ties
            np.subtract(x[start:stop, j, None], columns[j][None, :], out=scratch)
            np.multiply(scratch, scratch, out=scratch)
            dist += scratch
        # Self gets a distance below any real one, so it sorts first even among exact duplicates.
        dist[rows - start, rows] = -1.0
        order = np.argsort(dist, axis=1, kind="stable")
        out[start:stop] = order[:, 1:k + 1]

    starts = range(0, n, CHUNK_ROWS)
    workers = min(threads or usable_cpus(), len(starts))
    if workers == 1:
        for s in starts:
            chunk(s)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(chunk, starts))  # list() re-raises a worker's exception here
    return out


# ----------------------------------------------------------------------------- inputs and output

def load_codebook(path, raw=False, normalize=False):
    """The [N, D] vectors to compute neighbors on, and a few words saying which they are.

    A VQ checkpoint (.pt/.bin/.safetensors, loaded strictly through lantern.export.vq): the vectors
    the decoder consumes (L2-normalised rows when the codebook is normalised), or with raw=True the
    stored `quantize.embedding.weight` as the public LANTERN code uses it.
    A .npy array [N, D]: used as given (it is unknown whether a decoder would normalise it);
    normalize=True L2-normalises its rows first.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LanternError(f"{path}: no such file")
    if path.endswith(".npy"):
        if raw:
            raise LanternError("--raw applies to VQ checkpoints; a .npy codebook is always used as given")
        arr = read_npy(path, "codebook")  # header checked: a damaged one is one line, not a traceback
        if arr.ndim != 2:
            raise LanternError(f"{path}: codebook must be a 2-D array [codes, dim], got shape {list(arr.shape)}")
        if not normalize:
            return arr, "array as given"
        norms = np.linalg.norm(arr.astype(np.float64), axis=1, keepdims=True)
        if (norms == 0).any():
            raise LanternError(f"{path}: cannot L2-normalise: code {int(np.argmax(norms[:, 0] == 0))} is all zeros")
        return arr / norms, "array, L2-normalised rows"
    if normalize:
        raise LanternError("--normalize applies to .npy codebooks; a checkpoint's normalisation comes from its config")

    from lantern.export.vq import load_vq  # torch only for checkpoints

    model, _ = load_vq(path)
    if raw:
        return model.quantize.embedding.weight.detach().numpy(), "raw quantize.embedding.weight"
    what = "L2-normalised codes (as decoded)" if model.config.codebook_l2_norm else "codes (as decoded)"
    return model.code_vectors().detach().numpy(), what


def _check_output(path):
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise LanternError(f"{path}: output directory {directory} does not exist")
    if os.path.isdir(path):
        raise LanternError(f"{path}: is a directory")


def save_npy_atomic(path, array):
    """np.save to a temporary file next to `path`, then rename: readers never see a partial file.
    The file gets mode 0o666 less the umask (tempfile.mkstemp would make it private)."""
    import io


    path = os.fspath(path)
    _check_output(path)
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    write_file(path, buffer.getbuffer())


def add_parser(subparsers):
    p = subparsers.add_parser(
        "neighbors",
        help="codebook latent neighbors (the table LANTERN's relaxed acceptance reads)",
        description="For every code, the indices of the K nearest other codes by L2 distance, "
                    "nearest first, ties to the lower index; saved as an [N, K] .npy of the "
                    "smallest unsigned dtype that fits.")
    p.add_argument("codebook", help="VQ tokenizer checkpoint (.pt/.safetensors) or an .npy array [N, D]")
    p.add_argument("-o", "--output", required=True, help="output .npy path (written atomically)")
    p.add_argument("--k", type=int, default=None, help="neighbors per code (default: all, N-1)")
    p.add_argument("--raw", action="store_true",
                   help="checkpoint: use the stored codebook weights, not the L2-normalised vectors "
                        "the decoder consumes (what the public LANTERN generate_codebook.py does)")
    p.add_argument("--normalize", action="store_true", help=".npy input: L2-normalise rows first")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all usable CPUs)")
    p.set_defaults(func=run)
    return p


def run(args):
    if args.threads is not None and args.threads < 1:
        raise LanternError(f"--threads must be >= 1, got {args.threads}")
    _check_output(args.output)  # fail before the work, not after
    vectors, what = load_codebook(args.codebook, raw=args.raw, normalize=args.normalize)
    start = time.perf_counter()
    table = nearest_neighbors(vectors, k=args.k, threads=args.threads)
    seconds = time.perf_counter() - start
    save_npy_atomic(args.output, table)
    n, d = vectors.shape
    print(f"neighbors: N={n} D={d} k={table.shape[1]} dtype={table.dtype} vectors={what} "
          f"{seconds:.2f}s -> {args.output}")
    return 0
