"""The manifest on disk: reading manifest.json (parsed into records, checked, then the files it
lists checked against the directory), and the `files` records export writes. Writing is
Manifest.write (records.py).
"""
import json
import os
import sys

from lantern.runtime.enginedir import inside, load_json, onnx_external_files, open_file
from lantern.runtime.errors import LanternError
from lantern.runtime.integrity import REBUILD, sha256_file, verify_files
from lantern.runtime.manifest.checks import check_consistency
from lantern.runtime.manifest.records import REBUILD_PLANS, SCHEMA_VERSION, FileRecord, Manifest
from lantern.runtime.manifest.schema import Reader, read_record, to_json


def read_manifest(directory, verify=True):
    """Load and validate an engine directory's manifest: a Manifest, or LanternError saying what
    to rebuild. Every file's size is checked, and its sha256 unless verify is false (hashes are
    remembered per file version, so later opens cost a stat per file: runtime/integrity.py)."""
    directory = os.fspath(directory)
    path = os.path.join(directory, "manifest.json")
    if not os.path.isdir(directory):
        raise LanternError(f"{directory}: no such engine directory (build one with `lantern-export onnx`)")
    try:
        with open_file(directory, "manifest.json", "r") as f:
            data = load_json(f, path)
    except FileNotFoundError:
        raise LanternError(f"{directory}: no manifest.json; not an engine directory (build one with "
                           f"`lantern-export onnx`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LanternError(f"{path}: unreadable manifest ({e}); re-export the engine") from None
    manifest = _parse(data, path)
    manifest = check_files(directory, manifest, verify)
    _check_external_data(directory, manifest)
    return manifest


def _parse(data, where):
    schema = data.get("schema", data.get("format_version")) if isinstance(data, dict) else None
    if schema != SCHEMA_VERSION:
        raise LanternError(f"{where}: engine schema {schema!r} is not the supported {SCHEMA_VERSION}; "
                           f"re-export the engine with this version of `lantern-export onnx`")
    r = Reader(data, where)
    m = read_record(Manifest, r)
    check_consistency(m, r)
    return m


def _check_external_data(directory, manifest):
    """Every external-data file a graph names must be one the manifest lists (so it was
    confined and hashed): ONNX Runtime and TensorRT open whatever path a graph gives."""
    for name, g in manifest.all_graphs().items():
        base = os.path.dirname(g.file)
        for location in sorted(onnx_external_files(directory, g.file)):
            listed = os.path.normpath(os.path.join(base, location)).replace(os.sep, "/")
            if os.path.isabs(location) or listed not in manifest.files:
                raise LanternError(f"{directory}: {g.file} reads external data from {location!r}, which the "
                                   f"manifest does not list; re-export the engine with `lantern-export onnx`")


def check_files(directory, manifest, verify=True):
    """Sizes (and, with verify, sha256) of every file the manifest lists. Returns the manifest,
    less what a damaged file that generation does not need belongs to (a tuned entry: its tree
    or its report; one warning line each); every refusal names the cheapest repair."""
    retune = "run `lantern-run tune` again with these settings"
    tuned = {}  # file -> the tuned entries it belongs to
    for key, entry in manifest.tuned_trees.items():
        folder = os.path.dirname(entry.report) + "/" if entry.report else None
        for name in manifest.files:
            if name in {t.file for t in entry.trees} or (folder and name.startswith(folder)):
                tuned.setdefault(name, []).append(key)
    plans = {p.file for entry in (manifest.tensorrt or {}).values() for p in entry.plans.values()}
    groups = [(sorted(set(manifest.files) - set(tuned) - plans), None), (sorted(plans), REBUILD_PLANS)]
    groups += [(sorted(n for n, keys in tuned.items() if key in keys), retune) for key in manifest.tuned_trees]
    dropped = set()
    for names, fix in groups:
        if not names:
            continue
        try:
            _check_group(directory, {n: manifest.files[n] for n in names}, verify, fix)
        except LanternError as e:
            if fix != retune:
                raise
            keys = sorted({k for n in names for k in tuned[n]} - dropped)
            if not keys:
                continue
            print(f"lantern: warning: {e}; the tuned tree(s) {', '.join(keys)} are ignored until "
                  f"`lantern-run tune` runs again with their settings", file=sys.stderr)
            dropped |= set(keys)
    if not dropped:
        return manifest
    gone = {name for name, keys in tuned.items() if set(keys) & dropped}
    return manifest.replace(tuned_trees={k: v for k, v in manifest.tuned_trees.items() if k not in dropped},
                            files={k: v for k, v in manifest.files.items() if k not in gone})


def _check_group(directory, records, verify, fix):
    fix = fix or REBUILD
    files = {name: to_json(f) for name, f in records.items()}  # {"size", "sha256"}, as verify_files takes them
    if verify:
        verify_files(directory, files, fix=fix)
        return
    for name, entry in files.items():
        file = inside(directory, name)  # refuses names outside and links
        if not os.path.isfile(file):
            raise LanternError(f"{directory}: {name} is missing; {fix}")
        if os.path.getsize(file) != entry["size"]:
            raise LanternError(f"{directory}: {name} has {os.path.getsize(file)} bytes, the manifest says "
                               f"{entry['size']}; the file was changed or truncated; {fix}")


def describe_files(directory, names):
    """`files` records for the given relative paths."""
    return {name: FileRecord(size=os.path.getsize(os.path.join(directory, name)),
                             sha256=sha256_file(os.path.join(directory, name))) for name in sorted(names)}
