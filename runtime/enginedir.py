"""Confined, locked, atomic access to an engine directory, which is untrusted input (downloaded,
shared, or written by another user): docs/threat-model.md.

Reading and writing: `inside(directory, name)` is the only way from a manifest name to a path.
It refuses absolute names, `..`, and a symbolic link anywhere below the engine directory (a
file, a subdirectory such as tuned/ or plans/), so nothing is read from or written to outside
it through a planted link. Files are opened with O_NOFOLLOW on top of that.

Writing: `write_file` writes through a temporary file with a unique name created exclusively
(O_EXCL) beside its destination, then renames it into place; a full disk or a file-size limit
becomes one LanternError line and the temporary file is removed. Every command that changes an
engine that already exists (tune, trt) does so inside `locked(directory)`: an exclusive flock
on `.lantern.lock`, under which it re-reads the manifest, merges its change and writes the
manifest last. A second writer waits for the first; the kernel drops a
killed writer's lock, and whatever temporary files it left are removed by the next writer
(under the lock nobody else is writing). Long builds stage their files in a `staging`
directory that holds its own lock, so a later writer can tell a dead build's leftovers from a
running one's.

Standard library only (plus the manifest reader).
"""
import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import tempfile
import time

from lantern.runtime.errors import LanternError

LOCK_NAME = ".lantern.lock"
TMP_PREFIX = ".lantern-tmp-"  # temporary files of write_file
STAGE_PREFIX = ".lantern-stage-"  # staging directories of long builds
STAGE_OWNER = ".owner"
LOCK_WAIT_SECONDS = 600.0


def inside(directory, name, *, kind=None):
    """The path of manifest name `name` (a relative path with '/') in engine `directory`, after
    checking that it names something inside it: no absolute path, no '..', and no symbolic link
    at any component that exists. kind: 'file' or 'dir' to also require the last component, if
    present, to be one. Raises LanternError naming the path."""
    directory = os.fspath(directory)
    if not isinstance(name, str) or not name or os.path.isabs(name) or name.startswith("\\"):
        raise LanternError(f"{directory}: {name!r} is not a relative path inside the engine directory")
    parts = name.replace("\\", "/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise LanternError(f"{directory}: {name!r} leaves the engine directory or is not a plain relative path")
    path = directory
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return os.path.join(directory, *parts)
        except OSError as e:
            raise LanternError(f"{directory}: cannot read {'/'.join(parts[:i + 1])} ({e.strerror})") from None
        here = "/".join(parts[:i + 1])
        if stat.S_ISLNK(st.st_mode):
            raise LanternError(f"{directory}: {here} is a symbolic link; an engine directory holds no links (they "
                               f"could point outside it): replace it with the file itself or re-export the engine")
        last = i == len(parts) - 1
        if not last and not stat.S_ISDIR(st.st_mode):
            raise LanternError(f"{directory}: {here} is not a directory (the manifest names {name})")
        if last and kind == "file" and not stat.S_ISREG(st.st_mode):
            raise LanternError(f"{directory}: {name} is not a regular file")
        if last and kind == "dir" and not stat.S_ISDIR(st.st_mode):
            raise LanternError(f"{directory}: {name} is not a directory")
    return path


def open_file(directory, name, mode="rb"):
    """Open a file of the engine for reading, confined (inside) and without following a link."""
    path = inside(directory, name, kind="file")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def make_dirs(directory, name):
    """mkdir -p of `name` inside the engine (mode 0o777 less the umask), refusing links."""
    path = directory
    for part in name.replace("\\", "/").split("/"):
        path = os.path.join(path, part)
        inside(directory, os.path.relpath(path, directory), kind="dir")
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError as e:
            raise _write_error(directory, name, e) from None
    return path


def _write_error(directory, name, e):
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        why = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EFBIG: "the file-size limit was reached"}[e.errno]
        return LanternError(f"{directory}: cannot write {name}: {why}; free space (or raise the limit) and run "
                            f"again (the engine was left as it was)")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return LanternError(f"{directory}: cannot write {name} ({e.strerror}): the engine directory is read-only; "
                            f"copy it somewhere writable or run as its owner")
    return LanternError(f"{directory}: cannot write {name} ({e.strerror})")


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_file(directory, name, data):
    """bytes `data` to `name` in the engine directory, atomically: a unique temporary file made
    exclusively beside it, renamed over the destination (which must not be a link). Any OSError
    is one LanternError line; the temporary file never stays."""
    directory = os.fspath(directory)
    target = inside(directory, name, kind="file")
    parent = os.path.dirname(target)
    if os.path.normpath(parent) != os.path.normpath(directory):
        make_dirs(directory, os.path.relpath(parent, directory))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=parent)  # O_EXCL | O_NOFOLLOW
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise _write_error(directory, name, e) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return target


def check_writable(directory, what):
    """Before any long work: can `what` (a command) write into the engine? A real probe (a
    temporary file made and removed), so a read-only mount or a root-owned directory is caught
    whoever runs it. Raises LanternError with the cheapest way out."""
    directory = os.fspath(directory)
    try:
        fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise LanternError(f"{directory}: {what} writes into the engine directory, which is not writable "
                           f"({e.strerror}); copy the engine somewhere writable (or run as its owner)") from None


@contextlib.contextmanager
def locked(directory, what, wait=LOCK_WAIT_SECONDS):
    """Hold the engine's writer lock (flock on .lantern.lock) for the block. Waits for another
    writer up to `wait` seconds, then refuses in one line. Removes what dead writers left."""
    directory = os.fspath(directory)
    inside(directory, LOCK_NAME, kind="file")
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise _write_error(directory, LOCK_NAME, e) from None
    try:
        deadline, told = time.monotonic() + wait, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LanternError(f"{directory}: another command has been changing the engine for over "
                                       f"{wait:.0f} s; {what} gave up waiting, run it again later") from None
                if not told:
                    print(f"{what}: waiting for another command that is changing {directory}", file=sys.stderr)
                    told = True
                time.sleep(0.05)
        remove_leftovers(directory)
        yield
    finally:
        os.close(fd)


def remove_leftovers(directory):
    """Under the lock: temporary files of write_file in the directories writers use, and
    staging directories whose owner is gone (their lock is free)."""
    for sub in ("", "tuned", "plans"):
        folder = os.path.join(directory, sub)
        if sub and (os.path.islink(folder) or not os.path.isdir(folder)):
            continue
        folders = [folder] + ([os.path.join(folder, n) for n in os.listdir(folder)
                               if os.path.isdir(os.path.join(folder, n)) and not os.path.islink(os.path.join(folder, n))]
                              if sub == "tuned" else [])
        for f in folders:
            for entry in os.listdir(f):
                path = os.path.join(f, entry)
                if entry.startswith(TMP_PREFIX) and not os.path.isdir(path):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                # (.trt-*: build directories that older versions left behind)
                elif entry.startswith((STAGE_PREFIX, ".trt-")) and os.path.isdir(path) and not os.path.islink(path):
                    if not _stage_in_use(path):
                        shutil.rmtree(path, ignore_errors=True)


def _stage_in_use(path):
    try:
        fd = os.open(os.path.join(path, STAGE_OWNER), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # no owner file: made and left by a writer that died at once
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def staging(directory, label):
    """A private staging directory inside the engine for a long build (`.lantern-stage-LABEL-*`),
    locked for its life so remove_leftovers keeps it while this process runs. Removed on the
    way out unless the caller renamed it away."""
    directory = os.fspath(directory)
    try:
        path = tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{label}-", dir=directory)
        os.chmod(path, 0o777 & ~_umask())
        fd = os.open(os.path.join(path, STAGE_OWNER), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise _write_error(directory, f"{STAGE_PREFIX}{label}", e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


MAX_JSON_DEPTH = 64  # manifests and tree files nest a few levels; deeper is damage or an attack


def load_json(f, where):
    """json.load of an open text file, refusing nesting deeper than MAX_JSON_DEPTH in one line
    (Python's parser and every walker after it would hit the recursion limit)."""
    try:
        data = json.load(f)
    except RecursionError:
        data = None
    else:
        deepest, stack = 0, [(data, 1)]
        while stack and deepest <= MAX_JSON_DEPTH:
            value, depth = stack.pop()
            deepest = max(deepest, depth)
            if isinstance(value, dict):
                stack += [(v, depth + 1) for v in value.values()]
            elif isinstance(value, list):
                stack += [(v, depth + 1) for v in value]
        if deepest <= MAX_JSON_DEPTH:
            return data
    raise LanternError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels; not a file lantern writes")


# ONNX protobuf field numbers (onnx.proto3): the paths to every TensorProto a graph holds.
_MODEL_GRAPH, _GRAPH_NODE, _GRAPH_INITIALIZER, _GRAPH_SPARSE = 7, 1, 5, 15
_NODE_ATTRIBUTE, _ATTR_T, _ATTR_G, _ATTR_TENSORS, _ATTR_GRAPHS, _ATTR_SPARSE, _ATTR_SPARSES = 5, 5, 6, 10, 11, 22, 23
_SPARSE_VALUES, _SPARSE_INDICES = 1, 2
_TENSOR_EXTERNAL_DATA, _ENTRY_KEY, _ENTRY_VALUE = 13, 1, 2


def _fields(buf, start, end):
    """(field number, wire type, value) of one protobuf message; length-delimited values as
    (offset, end) into buf, never copied."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = None, pos + 8
        elif wire == 5:
            value, pos = None, pos + 4
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = (pos, pos + length), pos + length
        else:
            raise ValueError(f"wire type {wire}")
        if pos > end:
            raise ValueError("truncated message")
        yield number, wire, value


def _varint(buf, pos):
    shift = result = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("bad varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _tensor_locations(buf, span, out):
    for number, wire, value in _fields(buf, *span):
        if number == _TENSOR_EXTERNAL_DATA and wire == 2:
            entry = {n: bytes(buf[v[0]:v[1]]).decode("utf-8", "replace") for n, w, v in _fields(buf, *value) if w == 2}
            if entry.get(_ENTRY_KEY) == "location":
                out.add(entry.get(_ENTRY_VALUE, ""))


def _graph_locations(buf, span, out, depth=0):
    if depth > MAX_JSON_DEPTH:
        raise ValueError("subgraphs nested too deep")

    def sparse(v):
        for n, w, part in _fields(buf, *v):
            if n in (_SPARSE_VALUES, _SPARSE_INDICES) and w == 2:
                _tensor_locations(buf, part, out)

    for number, wire, value in _fields(buf, *span):
        if wire != 2:
            continue
        if number == _GRAPH_INITIALIZER:
            _tensor_locations(buf, value, out)
        elif number == _GRAPH_SPARSE:
            sparse(value)
        elif number == _GRAPH_NODE:
            for n, w, attr in _fields(buf, *value):
                if n != _NODE_ATTRIBUTE or w != 2:
                    continue
                for a, aw, v in _fields(buf, *attr):
                    if aw != 2:
                        continue
                    if a in (_ATTR_T, _ATTR_TENSORS):
                        _tensor_locations(buf, v, out)
                    elif a in (_ATTR_G, _ATTR_GRAPHS):
                        _graph_locations(buf, v, out, depth + 1)
                    elif a in (_ATTR_SPARSE, _ATTR_SPARSES):
                        sparse(v)


def onnx_external_files(directory, name):
    """The external-data locations every tensor of the ONNX file `name` (graph, subgraphs and
    constants) names, read from its protobuf without the onnx package. LanternError if the file
    is not a readable ONNX model."""
    import mmap

    with open_file(directory, name) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise LanternError(f"{directory}: {name} is empty, not an ONNX model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            out = set()
            try:
                for number, wire, value in _fields(buf, 0, size):
                    if number == _MODEL_GRAPH and wire == 2:
                        _graph_locations(buf, value, out)
            except ValueError as e:
                raise LanternError(f"{directory}: {name} is not a readable ONNX model ({e}); re-export the "
                                   f"engine") from None
    return out
