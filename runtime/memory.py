"""How much memory this process may still take: the smaller of what the kernel has available
(MemAvailable) and what the process's control group lets it grow by, since in a container the
host's free memory says nothing about the limit that gets the process killed.

cgroup v2: the process's group (from /proc/self/cgroup, `0::/PATH`) and each ancestor may set
`memory.max`; headroom = min over them of max - memory.current. cgroup v1: the same over the
memory controller's groups (`N:memory:/PATH`) with `memory.limit_in_bytes` -
`memory.usage_in_bytes` (a huge limit, the kernel's "unlimited", is ignored). Readers take the root paths as arguments so they can be tested on
files written for the purpose.
"""
import os

_UNLIMITED_V1 = 1 << 60  # v1 reports "no limit" as a page-rounded LONG_MAX


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def meminfo_available(path="/proc/meminfo"):
    """MemAvailable in bytes, or None where unknown."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _own_cgroup(proc_cgroup, controller):
    """The process's group path for `controller` ('' for v2's unified line `0::PATH`)."""
    try:
        with open(proc_cgroup) as f:
            for line in f:
                fields = line.rstrip("\n").split(":", 2)
                if len(fields) == 3 and (fields[1] == controller if not controller
                                         else controller in fields[1].split(",")):
                    return fields[2]
    except OSError:
        pass
    return None


def _groups(base, own):
    """base/own and each ancestor up to base, the group itself first."""
    parts = [p for p in (own or "").split("/") if p]
    return [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_headroom(root="/sys/fs/cgroup", proc_cgroup="/proc/self/cgroup"):
    """Bytes the process's memory cgroup lets it still allocate, or None without a limit."""
    best = None

    def consider(limit, usage):
        nonlocal best
        if limit is None or limit >= _UNLIMITED_V1:
            return
        room = max(limit - (usage or 0), 0)
        best = room if best is None else min(best, room)

    # A group's own path may be absent under root (a container mounts its own group as the root).
    if os.path.exists(os.path.join(root, "cgroup.controllers")):  # v2 unified hierarchy
        for folder in _groups(root, _own_cgroup(proc_cgroup, "")):
            consider(_read_int(os.path.join(folder, "memory.max")), _read_int(os.path.join(folder, "memory.current")))
        return best
    for folder in _groups(os.path.join(root, "memory"), _own_cgroup(proc_cgroup, "memory")):
        consider(_read_int(os.path.join(folder, "memory.limit_in_bytes")),
                 _read_int(os.path.join(folder, "memory.usage_in_bytes")))
    return best


def available_memory(meminfo="/proc/meminfo", cgroup_root="/sys/fs/cgroup", proc_cgroup="/proc/self/cgroup"):
    """Bytes this process can still take: min(MemAvailable, cgroup headroom); None if neither is known."""
    known = [v for v in (meminfo_available(meminfo), cgroup_headroom(cgroup_root, proc_cgroup)) if v is not None]
    return min(known) if known else None
