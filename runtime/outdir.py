"""Atomic output directories: a run's files appear at their destination together, or not at all.

A run writes into a hidden staging directory beside the destination, `.NAME.tmp-XXXXXXXX`, and
renames it into place when it succeeded. For its whole life it holds an exclusive lock (flock) on
`.NAME.lock` beside the destination, so:
- a second run to the same destination fails at once with one line naming the first (its pid);
- whatever a run finds beside the destination under the lock was left by a run that died (the
  kernel drops a dead process's lock): staging directories are removed, an old directory that
  a swap had set aside is restored when the destination is missing, and the lock file is reused.

What is at the destination is replaced only with `force`, and only when the caller's
`replaceable` test says it is the kind of directory the caller writes (an engine directory, a
previous run's outputs); an empty directory is always replaceable (nothing can be lost), a file
or a symbolic link never. The check is repeated under the lock at the swap against what was
there when the run started: anything that appeared or changed during the run (a user's folder,
a tool that does not take the lock) is not replaced; the finished result is then kept beside it
as NAME.unplaced-PID and the error says so.

Directories and files are created with mode 0o777 / 0o666 less the umask, as `mkdir` and
`open` make them (tempfile's are private, 0700 / 0600).

    with OutputDirectory("out", force=False) as stage:
        np.save(os.path.join(stage, "tokens.npy"), tokens)
    # "out" now holds exactly what was written into `stage`
"""
import errno
import fcntl
import fnmatch
import os
import secrets
import shutil
import sys

from lantern.runtime.errors import LanternError

# What `lantern-run generate` writes into --out.
GENERATE_FILES = ("tokens.npy", "stats.json", "image_*.png")


def only_files(patterns, writer):
    """A `replaceable` test: a directory whose entries are all regular files matching `patterns`
    (fnmatch), i.e. what `writer` writes, and nothing else."""
    def replaceable(path):
        for name in sorted(os.listdir(path)):
            if not any(fnmatch.fnmatchcase(name, p) for p in patterns) or not _is_plain_file(os.path.join(path, name)):
                return f"it holds {name!r}, which {writer} does not write"
        return None
    return replaceable


def _is_plain_file(path):
    return os.path.isfile(path) and not os.path.islink(path)


def write_file(path, data):
    """Write bytes to `path` with mode 0o666 less the umask (tempfile.mkstemp would make it
    0600), through a temporary name in the same directory so readers never see half a file."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        tmp = os.path.join(directory, f".{os.path.basename(path)}.part-{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def make_unique_dir(parent, prefix):
    """mkdir a new uniquely named directory `parent/prefix<hex>` with mode 0o777 less the umask."""
    while True:
        path = os.path.join(parent, f"{prefix}{secrets.token_hex(4)}")
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue


# ---------------------------------------------------------------------------------------------
# Checks without writing anything


def _a(noun):
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _identity(path):
    """What is at `path` now: None, or (device, inode) of the entry itself (links not followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def _first_existing_ancestor(path):
    parent = os.path.dirname(path)
    while parent and not os.path.lexists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    return parent


def check_destination(path, force=False, replaceable=None, kind="output directory", option="--out"):
    """Raise LanternError (one line) unless a run may put a directory at `path`; writes nothing.

    Allowed: nothing there (the parent may be missing), an empty directory, or with `force` a
    directory `replaceable(path)` accepts (it returns None, or a phrase saying why not)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.basename(path):
        raise LanternError(f"{option} {path}: not a usable {kind} path")
    ancestor = _first_existing_ancestor(path)
    if ancestor and not os.path.isdir(ancestor):
        raise LanternError(f"{option} {path}: {ancestor} is a file, not a directory")
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        raise LanternError(f"{option} {path} is a symbolic link; give the directory itself (not replacing a link)")
    if not os.path.isdir(path):
        raise LanternError(f"{option} {path} is a file; not replacing it with {_a(kind)}")
    try:
        entries = os.listdir(path)
    except OSError as e:
        raise LanternError(f"{option} {path}: cannot read it ({e.strerror})") from None
    if not entries:
        return
    if not force:
        raise LanternError(f"{path} already exists; pass --force to replace it")
    reason = replaceable(path) if replaceable is not None else "it is not empty"
    if reason:
        raise LanternError(f"{path} is not {_a(kind)} ({reason}); not replacing it, even with --force")


# ---------------------------------------------------------------------------------------------
# The lock beside the destination


def _read_pid(path):
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None


def _acquire_lock(lock_path, dest, option):
    """An open fd holding flock(LOCK_EX) on `lock_path`, which is the file at that name (a
    holder that released it may have unlinked the name between our open and our flock)."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            pid = _read_pid(lock_path)
            who = f"another run (pid {pid})" if pid else "another run"
            raise LanternError(f"{dest}: {who} is writing it now; wait for it to finish or choose another "
                               f"{option}") from None
        except BaseException:
            os.close(fd)
            raise
        held = os.fstat(fd)
        try:
            now = os.stat(lock_path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)  # the name now points elsewhere: lock that one


def _release_lock(fd, lock_path):
    try:
        os.unlink(lock_path)  # while still holding it, so no one can hold the old inode after us
    except FileNotFoundError:
        pass
    os.close(fd)


# ---------------------------------------------------------------------------------------------
# The staged directory


class OutputDirectory:
    """A directory built in a hidden staging directory and placed at `path` atomically.

    Use as a context manager (`with OutputDirectory(path) as stage:`; placed when the block
    ends without an exception, discarded otherwise), or call open() / place() / discard().
    `replaceable(path) -> None | reason` says which existing directories `force` may replace
    (default: a previous `lantern-run generate` output: only GENERATE_FILES in it)."""

    def __init__(self, path, force=False, replaceable=None, kind="output directory", option="--out"):
        self.path = os.path.abspath(os.fspath(path))
        self.force = force
        self.replaceable = replaceable or only_files(GENERATE_FILES, "lantern-run generate")
        self.kind = kind
        self.option = option
        self.stage = None
        self.notes = []  # what was cleaned up from interrupted runs, one line each
        self._lock = None
        self._seen = None  # identity of what was at path when the lock was taken
        self._replacing = False  # it was a non-empty directory that force allows replacing

    @property
    def _parent(self):
        return os.path.dirname(self.path)

    @property
    def _name(self):
        return os.path.basename(self.path)

    @property
    def _lock_path(self):
        return os.path.join(self._parent, f".{self._name}.lock")

    def _check(self):
        check_destination(self.path, self.force, self.replaceable, self.kind, self.option)

    def open(self):
        """Check the destination, take the lock, clean up after dead runs, make the staging
        directory; returns its path."""
        self._check()
        try:
            os.makedirs(self._parent, exist_ok=True)
        except OSError as e:
            raise LanternError(f"{self.option} {self.path}: cannot create {self._parent} ({e.strerror})") from None
        try:
            self._lock = _acquire_lock(self._lock_path, self.path, self.option)
        except OSError as e:
            raise LanternError(f"{self.option} {self.path}: cannot write in {self._parent} ({e.strerror})") from None
        try:
            self._clean_leftovers()
            self._check()  # again, under the lock (a restored directory, or one made meanwhile)
            self._seen = _identity(self.path)
            self._replacing = self._seen is not None and bool(os.listdir(self.path))
            self.stage = make_unique_dir(self._parent, f".{self._name}.tmp-")
        except BaseException:
            _release_lock(self._lock, self._lock_path)
            self._lock = None
            raise
        return self.stage

    def _clean_leftovers(self):
        """Under the lock every other staging or set-aside directory of this destination
        belongs to a run that died."""
        tmp_prefix, old_prefix = f".{self._name}.tmp-", f".{self._name}.old-"
        entries = sorted(os.listdir(self._parent))
        olds = [n for n in entries if n.startswith(old_prefix)]
        if olds and not os.path.lexists(self.path):
            # A run died mid-swap, after setting the previous directory aside: put it back.
            newest = max(olds, key=lambda n: os.lstat(os.path.join(self._parent, n)).st_mtime_ns)
            os.rename(os.path.join(self._parent, newest), self.path)
            olds.remove(newest)
            self._note(f"restored {self.path} from {newest}, set aside by an interrupted run")
        for name in [n for n in entries if n.startswith(tmp_prefix)] + olds:
            path = os.path.join(self._parent, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
            self._note(f"removed {path}, left by an interrupted run")

    def _note(self, line):
        self.notes.append(line)
        print(f"note: {line}", file=sys.stderr)

    def place(self):
        """Move the staging directory to the destination (re-checked under the lock) and
        release the lock. Returns the destination."""
        if self.stage is None:
            raise RuntimeError("OutputDirectory.place() before open()")
        try:
            self._swap()
        except OSError as e:  # e.g. a mount point, a read-only file system
            self._refuse(f"cannot move this run's {self.kind} there ({e.strerror})")
        finally:
            _release_lock(self._lock, self._lock_path)
            self._lock, self.stage = None, None
        return self.path

    def _refuse(self, why):
        kept = self._keep_unplaced()
        raise LanternError(f"{self.path}: {why}; this run's {self.kind} was kept at {kept}") from None

    def _keep_unplaced(self):
        """The finished result goes to a visible sibling (the next run would remove a hidden one)."""
        for i in range(100):
            kept = f"{self.path}.unplaced-{os.getpid()}" + (f"-{i}" if i else "")
            if not os.path.lexists(kept):
                try:
                    os.rename(self.stage, kept)
                    return kept
                except OSError:
                    continue
        return self.stage

    def _swap(self):
        now = _identity(self.path)
        if now != self._seen:
            self._refuse("something this run did not create was put there while it ran; not replacing it"
                         if self._seen is None else "it was replaced by something else while this run ran; "
                                                    "not replacing it")
        if now is None or not os.listdir(self.path):
            try:
                # rename replaces at most an empty directory: if anything was put there since the
                # check it fails (ENOTEMPTY, EEXIST, ENOTDIR) and nothing is lost.
                os.rename(self.stage, self.path)
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
                self._refuse("something was put there while this run ran; not replacing it")
        if not self._replacing:
            self._refuse("files were put there while this run ran; not replacing them")
        reason = self.replaceable(self.path)
        if reason:
            self._refuse(f"it changed while this run ran and is no longer {_a(self.kind)} ({reason}); "
                         f"not replacing it")
        old = make_unique_dir(self._parent, f".{self._name}.old-")
        os.rmdir(old)
        os.rename(self.path, old)
        if _identity(old) != self._seen:  # replaced between the check and the rename: put it back
            os.rename(old, self.path)
            self._refuse("it was replaced by something else while this run ran; not replacing it")
        try:
            os.rename(self.stage, self.path)
        except BaseException:
            os.rename(old, self.path)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def discard(self):
        """Remove the staging directory and release the lock (a failed run leaves nothing)."""
        if self.stage is not None:
            shutil.rmtree(self.stage, ignore_errors=True)
            self.stage = None
        if self._lock is not None:
            _release_lock(self._lock, self._lock_path)
            self._lock = None

    def __enter__(self):
        return self.open()

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.place()
        else:
            self.discard()
        return False
