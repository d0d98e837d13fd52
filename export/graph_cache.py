"""Exported graphs kept by what they were exported from (`lantern-export onnx --graph-cache DIR`).

The dynamo exporter takes seconds per graph even for a tiny model, and an export of the same
checkpoints with another tree, drafter, --neighbors-k or attention form traces graphs that did
not change (the VQ decoder, the condition graph, often the target). With a cache directory,
export_graph copies such a graph from the cache instead of tracing it again.

A graph's key is everything its file depends on: the file name and I/O contract (names, dtypes,
dims), the opset and whether the weights go to external data; the module's class, every
parameter and buffer (name, dtype, shape, bytes) and every plain attribute of it and its
submodules (numbers, strings, dtypes, containers and objects of them, such as the model's
config); the sources of lantern.export and lantern.runtime (the modules' code); and the versions
of torch, onnx, onnxscript and onnx_ir. A module holding anything else (a function, a hook, an
object without plain fields) is exported without the cache, as are streamed exports (weights
left on disk: the 7B ones, which a cache would copy whole).

An entry is a directory named by the key holding the graph's files under their engine names; it
appears by one rename when complete, so two exports writing the same entry at once leave one
whole copy. Only the files the export would write are read from it (the names are the engine's,
never listed from the cache)."""
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

import torch

KEY_VERSION = 1  # bump when what goes into the key changes
_PACKAGES = ("lantern.export", "lantern.runtime")


class _Uncacheable(Exception):
    """The module holds something the key cannot describe."""


def graph_key(module, io_spec, file_name, opset, external):
    """The hex key of exporting `module` to `file_name` under this contract, or None when the
    module cannot be described (module docstring)."""
    h = hashlib.sha256()
    try:
        head = {"key_version": KEY_VERSION, "file": file_name, "io": io_spec, "opset": opset, "external": external,
                "versions": _versions(), "default_dtype": str(torch.get_default_dtype()),
                "class": _qualname(type(module)), "attributes": _attributes(module)}
        h.update(json.dumps(head, sort_keys=True, default=_unplain).encode())
    except _Uncacheable:
        return None
    h.update(_sources_digest())
    for kind, named in (("parameter", module.named_parameters(remove_duplicate=False)),
                        ("buffer", module.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            data = tensor.detach().cpu().contiguous()
            h.update(f"{kind} {name} {data.dtype} {tuple(data.shape)}\n".encode())
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def fetch_graph(cache, key, path):
    """Copy the cached graph `key` to `path` (and `path`.data where the entry has it). Returns
    the file names written, or None when the cache has no such entry."""
    entry = os.path.join(cache, key)
    name = os.path.basename(path)

    def real_file(p):  # a planted link (to a file outside the cache) is no entry
        return os.path.isfile(p) and not os.path.islink(p)

    if os.path.islink(entry) or not real_file(os.path.join(entry, name)):
        return None
    names = [name] + ([name + ".data"] if real_file(os.path.join(entry, name + ".data")) else [])
    for n in names:
        shutil.copyfile(os.path.join(entry, n), os.path.join(os.path.dirname(path), n))
    return names


def store_graph(cache, key, path, names):
    """Put the files `names` written beside `path` into the cache as entry `key` (copies: the
    engine's files may be quantized in place afterwards). An entry already there is kept."""
    entry = os.path.join(cache, key)
    if os.path.lexists(entry):
        return
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=cache)
    try:
        for n in names:
            shutil.copyfile(os.path.join(os.path.dirname(path), n), os.path.join(tmp, n))
        os.rename(tmp, entry)
    except OSError:  # another export stored it first (rename onto a non-empty directory), or the disk is full
        shutil.rmtree(tmp, ignore_errors=True)


def _versions():
    from importlib import metadata

    out = {}
    for package in ("torch", "onnx", "onnxscript", "onnx_ir"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def _sources_digest():
    """sha256 over lantern.export's and lantern.runtime's .py files (names and contents)."""
    import importlib

    h = hashlib.sha256()
    for package in _PACKAGES:
        root = os.path.dirname(importlib.import_module(package).__file__)
        for directory, subdirs, files in sorted(os.walk(root)):
            subdirs.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    p = os.path.join(directory, f)
                    h.update(os.path.relpath(p, root).encode() + b"\0")
                    with open(p, "rb") as fh:
                        h.update(hashlib.sha256(fh.read()).digest())
    return h.digest()


def _qualname(cls):
    return f"{cls.__module__}.{cls.__qualname__}"


def _attributes(module):
    """Every submodule's non-tensor attributes, as plain values (torch.nn.Module keeps parameters,
    buffers and submodules in its own dicts, hashed apart; forward hooks must be empty)."""
    out = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        attrs = {}
        for k, v in vars(sub).items():
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            if "hook" in k:  # forward hooks change the traced graph; state-dict hooks do not
                if v and "forward" in k:
                    raise _Uncacheable(k)
                continue
            attrs[k] = _plain(v)
        out[name or "."] = [_qualname(type(sub)), attrs]
    return out


def _plain(v, depth=0):
    if depth > 8:
        raise _Uncacheable("too deep")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return ["dtype", str(v)]
    if isinstance(v, (tuple, list)):
        return [type(v).__name__, [_plain(x, depth + 1) for x in v]]
    if isinstance(v, (set, frozenset)):
        return ["set", sorted(repr(_plain(x, depth + 1)) for x in v)]
    if isinstance(v, dict):
        return ["dict", sorted((repr(k), _plain(x, depth + 1)) for k, x in v.items())]
    if isinstance(v, torch.Tensor):  # a plain tensor attribute (not a buffer): its bytes
        data = v.detach().cpu().contiguous()
        digest = hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        return ["tensor", str(data.dtype), list(data.shape), digest.hexdigest()]
    if isinstance(v, torch.nn.Module):  # a reference to a module listed elsewhere: its class
        return ["module", _qualname(type(v))]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return [_qualname(type(v)), [(f.name, _plain(getattr(v, f.name), depth + 1)) for f in dataclasses.fields(v)]]
    if isinstance(v, type):
        return ["class", _qualname(v)]
    if hasattr(v, "__dict__") and not callable(v):
        return [_qualname(type(v)), sorted((k, _plain(x, depth + 1)) for k, x in vars(v).items())]
    raise _Uncacheable(type(v).__name__)


def _unplain(v):
    raise _Uncacheable(type(v).__name__)
