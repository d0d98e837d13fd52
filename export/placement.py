"""Where a finished engine directory goes: atomically, and never over anything else.

`lantern-export onnx --out DIR` builds the engine in a hidden staging directory beside DIR
(`.DIR.tmp-XXXXXXXX`, mode 0o777 less the umask) and renames it to DIR at the end, holding a lock
on `.DIR.lock` from the start of the build to the swap (lantern.runtime.outdir does the work):

- DIR missing or an empty directory: the engine takes its place.
- DIR exists: refused without --force; with --force replaced only if it is an engine
  directory (it has a manifest.json), never another directory, a file or a link.
- The check is repeated under the lock at the swap: a folder that appeared at DIR during the
  export, or an engine that replaced the one there, is not replaced (the finished engine is kept
  as DIR.unplaced-PID and the error says so).
- A second export to DIR while one runs fails at once, naming the first one's pid.
- Leftovers of killed exports (`.DIR.tmp-*`, `.DIR.old-*`, the lock file) are removed by the
  next export to DIR; an old engine that a killed swap had set aside is put back first.
"""
import os

from lantern.runtime.outdir import OutputDirectory, check_destination


def is_engine_directory(path):
    """None when `path` is an engine directory that --force may replace; else why not."""
    manifest = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest) or os.path.islink(manifest):
        return "no manifest.json"
    return None


def check_engine_destination(out, force=False):
    """Raise LanternError (one line) unless an export may place an engine at `out`; writes
    nothing, so the export can fail before it loads anything."""
    check_destination(out, force, is_engine_directory, kind="engine directory")


def engine_directory(out, force=False):
    """The staged engine directory for `out`: open() -> staging path, place(), discard();
    or `with engine_directory(out, force) as staging:`."""
    return OutputDirectory(out, force, is_engine_directory, kind="engine directory")
