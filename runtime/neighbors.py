"""Loading an engine's latent-neighbour table (neighbors.npy) with every defect named in one line."""
import numpy as np

from lantern.runtime.errors import LanternError


def load_neighbors(path, codes):
    """[codes, k] integer table of each code's nearest codes, nearest first, self excluded."""
    try:
        table = np.load(path, allow_pickle=False, mmap_mode=None)
    except (OSError, ValueError, EOFError) as e:
        raise LanternError(f"{path}: not a readable neighbour table ({str(e).splitlines()[0]}); re-export the engine "
                           f"or rebuild the table with `lantern-export neighbors`") from None
    if not isinstance(table, np.ndarray) or table.ndim != 2 or table.shape[0] != codes or table.shape[1] < 1:
        raise LanternError(f"{path}: neighbour table has shape {getattr(table, 'shape', None)}, expected ({codes}, k): "
                           f"one row per code; re-export the engine")
    if not np.issubdtype(table.dtype, np.integer):
        raise LanternError(f"{path}: neighbour table holds {table.dtype}, not integer code ids; re-export the engine")
    if table.size and (table.min() < 0 or table.max() >= codes):
        raise LanternError(f"{path}: neighbour table holds ids outside [0, {codes}); re-export the engine")
    return table
