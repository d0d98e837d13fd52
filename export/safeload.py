"""Loading pickled checkpoints without executing code: torch's weights-only unpickler plus an
explicit allow-list of the few non-tensor classes real LlamaGen checkpoints contain."""
import argparse
import os
import zipfile

import torch

from lantern.runtime.errors import LanternError

# LlamaGen's training scripts store their argparse Namespace under 'args'. Nothing else is allowed.
ALLOWED_GLOBALS = [argparse.Namespace]


def load_pickle(path):
    """torch.load with weights_only=True; any failure becomes one clear LanternError line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise LanternError(f"{path}: no such file")
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except (zipfile.BadZipFile, EOFError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LanternError(f"{path}: unreadable or truncated checkpoint ({first})") from None
    except Exception as e:  # the weights-only unpickler refusing a global lands here
        msg = str(e).strip().splitlines()
        first = next((line for line in msg if "Unsupported global" in line), msg[0] if msg else type(e).__name__)
        raise LanternError(f"{path}: refused to load (it needs code outside the allow-list: {first.strip()})") from None


def load_state_file(path):
    """A tensor file: safetensors by extension, otherwise a weights-only pickle."""
    path = os.fspath(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        if not os.path.isfile(path):
            raise LanternError(f"{path}: no such file")
        try:
            return load_file(path)
        except Exception as e:  # safetensors raises its own error type, which moved between versions
            raise LanternError(f"{path}: unreadable or truncated safetensors file ({e})") from None
    return load_pickle(path)
