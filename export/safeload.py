"""Loading pickled checkpoints without executing code: torch's weights-only unpickler plus an
explicit allow-list of the few non-tensor classes real LlamaGen checkpoints contain."""
import argparse
import os
import re
import warnings
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
        # warnings: torch comments on pickle protocols on stderr; the outcome is what matters
        with torch.serialization.safe_globals(ALLOWED_GLOBALS), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except (zipfile.BadZipFile, EOFError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LanternError(f"{path}: unreadable or truncated checkpoint ({first})") from None
    except Exception as e:  # the weights-only unpickler refusing a global lands here
        raise LanternError(f"{path}: refused to load: {_refusal(str(e))}") from None


def _refusal(text):
    """What the weights-only unpickler refused, in our words. Torch's message advises retrying
    with weights_only=False or allow-listing the global, the one thing not to do with a file of
    unknown origin, so none of it is repeated."""
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return (f"it needs {found.group(1)}, which is not on the allow-list (tensors, plain containers, "
                f"argparse.Namespace); a pickle that names other code could run it")
    advice = ("weights_only", "safe_globals", "trusted source", "documentation of torch.load", "pytorch.org")
    detail = [line.strip() for line in text.splitlines() if line.strip() and not any(a in line for a in advice)]
    return ("it is not a weights-only pickle" + (f" ({detail[0]})" if detail else "")
            + "; only tensors, plain containers and argparse.Namespace are loaded")


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
