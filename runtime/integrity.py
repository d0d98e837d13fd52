"""Engine integrity: content hashes checked before serving, and tables read without trusting them.

`verify_files(directory, files)` checks every file a manifest lists ({name: {"size", "sha256"}})
against its sha256. Hashing a GPT-XL engine (~3.5 GB) takes seconds, so each file version is
hashed once and remembered: a version is (device, inode, size, mtime_ns, ctime_ns) of the file.
ctime changes whenever the file's content or metadata changes and cannot be set back by its
owner (mtime can: `touch -d`), so a rewritten, truncated or replaced file is hashed again while
an unchanged one is not. The memory is a small JSON file in the user's cache directory
($XDG_CACHE_HOME/lantern/verified-files.json, default ~/.cache/lantern); it holds digests the
process computed itself and is compared against the manifest every time, so a wrong hash in
the manifest is caught on later opens too. An unwritable cache only costs time.

`read_npy(path, what)` / `load_neighbors(path, vocab_size)`: an .npy from an engine directory,
header, size, dtype and values checked, any damage one LanternError line (numpy's own parser
lets a damaged header escape as tokenize.TokenError, and trusts the shape it declares).

Standard library and numpy only.
"""
import hashlib
import json
import math
import os
import time

import numpy as np
from numpy.lib import format as npy

from lantern.runtime.enginedir import inside
from lantern.runtime.errors import LanternError

REBUILD = "rebuild the engine with `lantern-export onnx`"
CACHE_ENTRIES = 4096  # file versions remembered (oldest forgotten first)
_CHUNK = 4 << 20


def sha256_file(path):
    h = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def default_cache_path():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "lantern", "verified-files.json")


def _version(st):
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class HashCache:
    """Remembered digests of file versions: {version: [sha256, last use]}. `path=None` remembers
    nothing (every open hashes)."""

    def __init__(self, path=None):
        self.path = path
        self.entries = {}
        self.changed = False
        if path is not None:
            try:
                with open(path) as f:
                    data = json.load(f)
                if isinstance(data, dict):
                    self.entries = {k: v for k, v in data.items()
                                    if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)}
            except (OSError, ValueError):
                pass  # no cache yet, or a damaged one: start afresh

    def digest(self, path, st):
        """sha256 of the file at `path` whose os.stat is `st`, hashed only if this version is new."""
        key = _version(st)
        entry = self.entries.get(key)
        if entry is None:
            entry = [sha256_file(path), 0]
            # The file must not have changed while it was hashed (else the digest is of neither).
            if _version(os.stat(path)) != key:
                return entry[0]
        entry[1] = time.time()
        self.entries[key] = entry
        self.changed = True
        return entry[0]

    def save(self):
        if self.path is None or not self.changed:
            return
        keep = dict(sorted(self.entries.items(), key=lambda kv: kv[1][1])[-CACHE_ENTRIES:])
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(keep, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # an unwritable cache only costs time


def _entry_error(directory, name, entry, fix=REBUILD):
    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        return f"{directory}: the manifest lists a file {name!r} outside the engine directory; {fix}"
    if not isinstance(entry, dict):
        return f"{directory}: the manifest's entry for {name} is not a {{size, sha256}} record; {fix}"
    size, digest = entry.get("size"), entry.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"{directory}: the manifest gives {name} no valid size ({size!r}); {fix}"
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return f"{directory}: the manifest gives {name} no valid sha256 ({digest!r}); {fix}"
    return None


def verify_files(directory, files, cache="default", fix=REBUILD):
    """Check every file of `files` (manifest['files']: {name: {"size", "sha256"}}) in `directory`:
    present, a regular file, of that size and that sha256. Raises LanternError saying which file
    and what to rebuild; returns None when all match.

    cache: "default" (the user cache file), a path, or None (hash everything every time).
    fix: the repair the messages name (the cheapest for these files)."""
    directory = os.fspath(directory)
    if not isinstance(files, dict) or not files:
        raise LanternError(f"{directory}: the manifest lists no files (expected {{name: {{size, sha256}}}}); {fix}")
    for name, entry in files.items():
        problem = _entry_error(directory, name, entry, fix)
        if problem:
            raise LanternError(problem)
    memory = HashCache(default_cache_path() if cache == "default" else cache)
    try:
        stats = {}
        for name, entry in sorted(files.items()):  # sizes of all first: cheap and the commonest damage
            path = inside(directory, name)  # no link followed out of the directory
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise LanternError(f"{directory}: {name} is missing; {fix}") from None
            except OSError as e:
                raise LanternError(f"{directory}: cannot read {name} ({e.strerror}); {fix}") from None
            if not os.path.isfile(path):
                raise LanternError(f"{directory}: {name} is not a regular file; {fix}")
            if st.st_size != entry["size"]:
                raise LanternError(f"{directory}: {name} has {st.st_size} bytes, the manifest says {entry['size']} "
                                   f"(changed or truncated); {fix}")
            stats[name] = (path, st)
        for name, (path, st) in stats.items():
            try:
                digest = memory.digest(path, st)
            except OSError as e:
                raise LanternError(f"{directory}: cannot read {name} ({e.strerror}); {fix}") from None
            if digest != files[name]["sha256"]:
                raise LanternError(f"{directory}: {name} does not match its sha256 in the manifest (the file is "
                                   f"corrupted or was changed, or the manifest was edited); {fix}")
    finally:
        memory.save()


# ---------------------------------------------------------------------------------------------
# Tables


def read_npy(path, what):
    """An array from an .npy file whose header, size and dtype were checked first (no pickles);
    any damage becomes one LanternError line naming the file."""
    path = os.fspath(path)

    def damaged(why):
        return LanternError(f"{path}: damaged {what} ({why})")

    try:
        with open(path, "rb") as f:
            if f.read(6) != npy.MAGIC_PREFIX:
                raise damaged("not an .npy file: no NumPy header")
            f.seek(0)
            try:
                version = npy.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = npy.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, fortran, dtype = npy.read_array_header_2_0(f)
                else:
                    raise ValueError(f"unsupported .npy format version {version}")
            except Exception as e:  # a damaged header fails in numpy's parser in many ways
                raise damaged(f"unreadable .npy header: {' '.join(str(e).split()) or type(e).__name__}") from None
            if dtype.hasobject:
                raise damaged(f"dtype {dtype} holds Python objects")
            expected = math.prod(shape) * dtype.itemsize
            actual = os.fstat(f.fileno()).st_size - f.tell()
            if actual != expected:
                raise damaged(f"the header declares {dtype} {list(shape)}, {expected} bytes of data, "
                              f"the file has {actual}")
            try:
                return np.load(path, allow_pickle=False)
            except Exception as e:
                raise damaged(' '.join(str(e).split()) or type(e).__name__) from None
    except FileNotFoundError:
        raise LanternError(f"{path}: {what} is missing") from None
    except OSError as e:
        raise LanternError(f"{path}: cannot read {what} ({e.strerror})") from None


def load_neighbors(path, vocab_size=None, k=None):
    """The latent-neighbor table [V, k] (unsigned integers < V, nearest first) of an engine, or
    one LanternError line saying it is damaged and to rebuild. vocab_size / k: what the manifest
    says (checked when given)."""
    what = "neighbor table"
    table = read_npy(path, what)
    fix = f"; {REBUILD} (or `lantern-export neighbors`)"
    if table.ndim != 2 or table.shape[1] < 1:
        raise LanternError(f"{path}: damaged {what}: expected [codes, k >= 1], got shape {list(table.shape)}{fix}")
    if table.dtype.kind != "u":
        raise LanternError(f"{path}: damaged {what}: expected unsigned integer indices, got {table.dtype}{fix}")
    if vocab_size is not None and table.shape[0] != vocab_size:
        raise LanternError(f"{path}: {what} has {table.shape[0]} rows but the vocabulary has {vocab_size} codes{fix}")
    if k is not None and table.shape[1] != k:
        raise LanternError(f"{path}: {what} has k = {table.shape[1]}, the manifest says {k}{fix}")
    if table.size and int(table.max()) >= table.shape[0]:
        raise LanternError(f"{path}: damaged {what}: index {int(table.max())} is outside the {table.shape[0]} codes{fix}")
    if (table == np.arange(table.shape[0], dtype=table.dtype)[:, None]).any():
        raise LanternError(f"{path}: damaged {what}: a code lists itself as its own neighbor{fix}")
    return table
