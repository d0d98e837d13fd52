"""Engine directories as untrusted input, writers that compose, requests refused up front (issue
21), on the tiny real engines: links planted in an engine for the readers, tune and trt;
concurrent and killed writers (subprocesses, bounded in time); the memory estimate against a
measured peak; cgroup limits; positions and vocabulary; one-line errors; threads sharing an
Engine; what the summary says ran."""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from lantern.runtime import enginedir
from lantern.runtime.errors import LanternError
from lantern.runtime.generator import Engine
from lantern.runtime.manifest import read_manifest
from lantern.runtime.memory import available_memory, cgroup_headroom
from lantern.runtime.settings import GenerationSettings
from lantern.runtime.tree import build_tree, root_only
from lantern.tools import tune, tune_record
from lantern.tools.run_cli import main as run_main

SETTINGS = dict(mode="lantern++", lam=3.0, k=8, cfg_scale=2.0)
PYTHON = sys.executable
TIMEOUT = 240  # seconds any subprocess here may run


@pytest.fixture(scope="module")
def report(c2i_engine):
    """One small tune run (batch 1) whose report the writers below install under various keys."""
    engine = Engine(c2i_engine, threads=1)
    settings = tune.tuning_settings(engine, GenerationSettings(**SETTINGS))
    conds, note = tune.conditions(engine, 2)
    report, _ = tune.tune(engine, settings, conds, budget=6, depth=2, batches=(1,), repeats=1, loop_runs=1, note=note,
                          threads=1, log=lambda *a: None)
    return json.loads(json.dumps(report))


def keyed(report, lam):
    settings = GenerationSettings(mode="lantern++", k=8, lam=lam, cfg_scale=2.0)
    return {**report, "key": settings.key, "settings": settings.canonical()}


def copy(engine, tmp_path, name="engine"):
    return str(shutil.copytree(engine, tmp_path / name))


def one_line(err):
    text = str(err.value)
    assert text and "\n" not in text
    return text


class CountingBackend:
    """An opened backend that counts the work asked of it (plans bound, graphs run): "refused up
    front" is checked as no work done, not as wall-clock time, which a busy machine stretches."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def bind(self, *args, **kwargs):
        self.calls += 1
        return self.inner.bind(*args, **kwargs)

    def run(self, call):
        self.calls += 1
        return self.inner.run(call)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def leftovers(directory):
    return [os.path.relpath(os.path.join(root, n), directory) for root, dirs, files in os.walk(directory)
            for n in dirs + files if n.startswith((enginedir.TMP_PREFIX, enginedir.STAGE_PREFIX, ".trt-"))
            or n.endswith(".tmp")]


WRITER = """
import json, sys
from lantern.runtime.errors import LanternError
from lantern.runtime.tree import build_tree
from lantern.tools import tune_record
d, rounds, reports = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
reports = [json.load(open(p)) for p in reports]
print("ready", flush=True)
try:
    for i in range(rounds):
        tune_record.install(d, {1: build_tree("chain-2", name=f"r{i}")}, reports[i % len(reports)])
except LanternError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
"""


def start_writer(tmp_path, d, rounds, *reports, **popen):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    paths = []
    for i, r in enumerate(reports):
        path = tmp_path / f"report-{r['key']}-{i}.json"
        path.write_text(json.dumps(r))
        paths.append(str(path))
    return subprocess.Popen([PYTHON, str(script), d, str(rounds)] + paths, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def finish(proc):
    out, err = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out, err


# ---------------------------------------------------------------------------------------------
# Confinement


def test_inside_refuses_escapes_and_links(tmp_path):
    d = tmp_path / "e"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "f").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (d / "link").symlink_to(outside)
    (d / "sub" / "flink").symlink_to(d / "sub" / "f")
    assert enginedir.inside(d, "sub/f", kind="file") == os.path.join(d, "sub", "f")
    assert enginedir.inside(d, "sub/new") == os.path.join(d, "sub", "new")  # absent: fine to create
    for name, words in (("/etc/passwd", "not a relative path"), ("../x", "leaves the engine"),
                        ("sub/../../x", "leaves the engine"), ("link/x", "link is a symbolic link"),
                        ("sub/flink", "sub/flink is a symbolic link"), ("sub/f/x", "sub/f is not a directory")):
        with pytest.raises(LanternError) as err:
            enginedir.inside(d, name)
        assert words in one_line(err), name


@pytest.mark.parametrize("name", ["neighbors.npy", "target.onnx", "manifest.json"])
@pytest.mark.parametrize("verify", [True, False])
def test_readers_refuse_a_link_out_of_the_engine(c2i_engine, tmp_path, name, verify):
    d = copy(c2i_engine, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(os.path.join(d, name), outside / name)  # the very same bytes: the hash alone would pass
    os.symlink(outside / name, os.path.join(d, name))
    with pytest.raises(LanternError) as err:
        Engine(d, threads=1, verify=verify)
    assert f"{name} is a symbolic link" in one_line(err)


def test_a_linked_tuned_directory_is_ignored_with_a_warning_and_never_written(c2i_engine, report, tmp_path, capsys):
    d = copy(c2i_engine, tmp_path)
    tune_record.install(d, {1: build_tree("chain-2", name="t")}, report)
    outside = tmp_path / "outside-tuned"
    shutil.move(os.path.join(d, "tuned"), outside)
    os.symlink(outside, os.path.join(d, "tuned"))
    before = sorted(os.listdir(outside))
    engine = Engine(d, threads=1)
    err = capsys.readouterr().err
    assert "tuned is a symbolic link" in err and "lantern-run tune" in err and len(err.strip().splitlines()) == 1
    assert engine.generate(classes=[1], **SETTINGS).stats["tree"] == engine.manifest.tree["name"]
    with pytest.raises(LanternError) as error:
        tune_record.install(d, {1: build_tree("chain-1", name="u")}, keyed(report, 4.0))
    assert "tuned is a symbolic link" in one_line(error)
    assert sorted(os.listdir(outside)) == before


def test_tune_writes_nothing_through_planted_links(c2i_engine, report, tmp_path):
    d = copy(c2i_engine, tmp_path)
    key = report["key"]
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.makedirs(os.path.join(d, "tuned", key))
    for planted in ("manifest.json.tmp", f"tuned/{key}/report.md.tmp", f"tuned/{key}.b1.json.tmp"):
        os.symlink(victim, os.path.join(d, planted))
    tune_record.install(d, {1: build_tree("chain-2", name="t")}, report)
    assert victim.read_text() == "keep me"
    assert not os.path.islink(os.path.join(d, "manifest.json"))
    assert key in read_manifest(d, verify=True).tuned_trees
    # a link where the report directory goes: refused in one line, nothing written through it
    d2 = copy(c2i_engine, tmp_path, "engine2")
    target = tmp_path / "outside-report"
    target.mkdir()
    os.makedirs(os.path.join(d2, "tuned"))
    os.symlink(target, os.path.join(d2, "tuned", key))
    with pytest.raises(LanternError) as err:
        tune_record.install(d2, {1: build_tree("chain-2", name="t")}, report)
    assert f"tuned/{key} is a symbolic link" in one_line(err)
    assert os.listdir(target) == []
    assert read_manifest(d2, verify=True).tuned_trees == {}


def test_trt_refuses_planted_plan_links_before_building(c2i_engine, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    from lantern.export import trt_export

    for planted in ("plans", "plans/tensorrt-rtx-SM89"):
        d = copy(c2i_engine, tmp_path, planted.replace("/", "-"))
        outside = tmp_path / f"outside-{planted.replace('/', '-')}"
        outside.mkdir()
        os.makedirs(os.path.dirname(os.path.join(d, planted)), exist_ok=True)
        os.symlink(outside, os.path.join(d, planted))
        with pytest.raises(LanternError) as err:
            trt_export.build_engine_plans(d, compute_capabilities=["89"], batches=[1], cfg=False)
        assert f"{planted} is a symbolic link" in one_line(err)
        assert os.listdir(outside) == [] and leftovers(d) == []


# ---------------------------------------------------------------------------------------------
# Writers that compose


def test_two_tunes_at_once_keep_both_entries(c2i_engine, report, tmp_path):
    d = copy(c2i_engine, tmp_path)
    a, b = keyed(report, 4.0), keyed(report, 5.0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    procs = [start_writer(tmp_path / "a", d, 4, a), start_writer(tmp_path / "b", d, 4, b)]
    results = [finish(p) for p in procs]
    assert [r[0] for r in results] == [0, 0], results
    m = read_manifest(d, verify=True)
    assert {a["key"], b["key"]} <= set(m.tuned_trees)
    # the same settings at once: both finish, the engine stays valid, one of their entries is there
    procs = [start_writer(tmp_path / "a", d, 4, a), start_writer(tmp_path / "b", d, 4, a)]
    assert [finish(p)[0] for p in procs] == [0, 0]
    m = read_manifest(d, verify=True)
    assert {a["key"], b["key"]} <= set(m.tuned_trees) and leftovers(d) == []


def test_trt_during_a_tune_keeps_the_tuned_entry(c2i_engine, report, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    d = copy(c2i_engine, tmp_path)
    trt = subprocess.Popen([PYTHON, "-m", "lantern.export.cli", "trt", d, "--compute-capability", "89", "--batch", "1",
                            "2", "4", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not [n for n in os.listdir(d) if n.startswith(enginedir.STAGE_PREFIX)]:  # trt read its manifest
            assert trt.poll() is None and time.monotonic() < deadline, trt.communicate()
            time.sleep(0.05)
        writer = start_writer(tmp_path, d, 2, report)
        assert finish(writer)[0] == 0
        assert trt.poll() is None  # the tune landed while trt was building from the manifest it read first
        code, out, err = finish(trt)
        assert code == 0, err
    finally:
        trt.kill()
    m = read_manifest(d, verify=True)
    assert report["key"] in m.tuned_trees and "tensorrt-rtx-SM89" in m.tensorrt


def test_kill_9_of_a_writer_at_any_moment_leaves_a_valid_engine(c2i_engine, report, tmp_path):
    d = copy(c2i_engine, tmp_path)
    reports = [keyed(report, 4.0), keyed(report, 5.0), report]
    for delay in (0.0, 0.05, 0.15, 0.3, 0.6):
        writer = start_writer(tmp_path, d, 1000, *reports)
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
        writer.communicate(timeout=TIMEOUT)
        engine = Engine(d, threads=1)  # every listed file matches its hash
        assert engine.generate(classes=[1, 2], **SETTINGS).tokens.shape == (2, 36)
    tune_record.install(d, {1: build_tree("chain-1", name="last")}, report)  # the lock was not left held
    assert leftovers(d) == []  # the next writer removed what the killed ones left
    assert read_manifest(d, verify=True).tuned_trees[report["key"]].trees[0].name == "last"


def test_a_killed_trt_build_leaves_nothing_the_next_writer_keeps(c2i_engine, report, tmp_path):
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed (pip install 'lantern[tensorrt-rtx]')")
    d = copy(c2i_engine, tmp_path)
    trt = subprocess.Popen([PYTHON, "-m", "lantern.export.cli", "trt", d, "--compute-capability", "89", "--batch", "1",
                            "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT
    while not (stage := [n for n in os.listdir(d) if n.startswith(enginedir.STAGE_PREFIX)]):
        assert trt.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    trt.kill()
    trt.wait(timeout=TIMEOUT)
    assert os.path.isdir(os.path.join(d, stage[0]))
    Engine(d, threads=1).generate(classes=[1], mode="exact", greedy=True)
    tune_record.install(d, {1: build_tree("chain-1")}, report)
    assert leftovers(d) == []


def test_a_damaged_tune_report_degrades_with_a_warning_and_says_re_tune(c2i_engine, report, tmp_path, capsys):
    d = copy(c2i_engine, tmp_path)
    tune_record.install(d, {1: build_tree("chain-2", name="t")}, report)
    with open(os.path.join(d, "tuned", report["key"], "acceptance.png"), "r+b") as f:
        f.write(b"\0" * 16)  # same size, other bytes
    assert run_main(["generate", d, *generation_argv(SETTINGS), "--classes", "1", "--threads", "1",
                     "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "acceptance.png does not match its sha256" in err and "run `lantern-run tune` again" in err
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["tree_source"] == "exported"
    tune_record.install(d, {1: build_tree("chain-2", name="t")}, report)  # re-tuning repairs it
    assert report["key"] in read_manifest(d, verify=True).tuned_trees


def generation_argv(s):
    return ["--mode", s["mode"], "--lam", str(s["lam"]), "--k", str(s["k"]), "--cfg-scale", str(s["cfg_scale"])]


def _read_only(directory, argv):
    """argv run with `directory` read-only for it: a private read-only bind mount in a mount
    namespace of its own when we are root (root ignores permissions), else mode bits."""
    if os.geteuid() != 0:
        for folder, _, files in os.walk(directory):
            os.chmod(folder, 0o555)
        return argv
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind -o ro "$0" "$0" && exec "$@"', directory]
    if shutil.which("unshare") is None or subprocess.run(wrap + ["true"], capture_output=True).returncode != 0:
        pytest.skip("running as root without a private read-only mount (unshare --mount): nothing is read-only")
    return wrap + argv


def test_a_read_only_engine_is_refused_before_the_work(c2i_engine, tmp_path):
    d = copy(c2i_engine, tmp_path)
    commands = [[PYTHON, "-m", "lantern.tools.run_cli", "tune", d, "--threads", "1", "--budget", "4", "--depth", "2",
                 "--images", "1", "--repeats", "1"]]
    if _has_tensorrt_rtx():
        commands.append([PYTHON, "-m", "lantern.export.cli", "trt", d, "--compute-capability", "89", "--no-progress"])
    try:
        for argv in commands:
            p = subprocess.run(_read_only(d, argv), capture_output=True, text=True, timeout=TIMEOUT)
            assert p.returncode == 2, p.stderr
            assert "not writable" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
            assert "[1/3]" not in p.stdout  # refused before any measurement or build
    finally:
        for folder, _, _ in os.walk(d):
            os.chmod(folder, 0o755)


def _has_tensorrt_rtx():
    try:
        import tensorrt_rtx  # noqa: F401
    except ImportError:
        return False
    return True


def _file_size_limit(limit):
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_file_size_limit_is_one_line_and_leaves_the_engine_valid(c2i_engine, report, tmp_path):
    d = copy(c2i_engine, tmp_path)
    tune_record.install(d, {1: build_tree("chain-1", name="before")}, keyed(report, 4.0))
    writer = start_writer(tmp_path, d, 1, report, preexec_fn=_file_size_limit(3000))  # the report.json is larger
    code, _, err = finish(writer)
    assert code == 2 and "file-size limit" in err and len(err.strip().splitlines()) == 1, err
    m = read_manifest(d, verify=True)
    assert keyed(report, 4.0)["key"] in m.tuned_trees and leftovers(d) == []  # the earlier entry stays
    out = tmp_path / "out"
    p = subprocess.run([PYTHON, "-m", "lantern.tools.run_cli", "generate", d, "--mode", "exact", "--greedy",
                        "--classes", "1", "--threads", "1", "--out", str(out)], capture_output=True, text=True,
                       timeout=TIMEOUT, preexec_fn=_file_size_limit(1000))
    assert p.returncode == 2 and "cannot write the outputs" in p.stderr and len(p.stderr.strip().splitlines()) == 1, \
        p.stderr
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".out")]


# ---------------------------------------------------------------------------------------------
# Refused up front


PROBE = """
import json, sys
import numpy as np
from lantern.runtime.generator import DECODE_CHUNK, Engine
from lantern.runtime.plan import decode_bytes, estimate_bytes

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

d, n = sys.argv[1], int(sys.argv[2])
engine = Engine(d, threads=1)
engine.decode(engine.generate(classes=[1], mode="lantern++", cfg_scale=2.0).tokens)  # sessions and arenas warm
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) restarts from here
classes = list(np.arange(n) % 10)
out = engine.generate(classes=classes, mode="lantern++", cfg_scale=2.0)
generation = status("VmHWM") - base
engine.decode(out.tokens)
decoding = status("VmHWM") - base
estimate = estimate_bytes(engine.manifest, engine._plan.tree, engine.condition.prefix(True, classes=classes), 4)
print(json.dumps(dict(generation=generation, decoding=decoding, estimate=estimate,
                      decode_estimate=decode_bytes(engine.manifest, n, DECODE_CHUNK))))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures the peak RSS through Linux /proc")
def test_the_memory_estimate_covers_a_measured_peak(c2i_engine, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    p = subprocess.run([PYTHON, str(script), c2i_engine, "200"], capture_output=True, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["generation"] > 32 * 2**20  # the batch, not noise, dominates what is measured
    # covers the peak, and not by so much that it refuses what fits (loose: RSS varies by machine)
    assert r["generation"] <= r["estimate"] <= 3 * r["generation"], r
    assert r["decoding"] <= r["estimate"] + r["decode_estimate"], r


def test_requests_the_memory_cannot_hold_are_refused_up_front(c2i_engine):
    backend = CountingBackend(Engine(c2i_engine, threads=1).backend)
    engine = Engine(c2i_engine, backend=backend, memory_limit=64 * 2**20)
    with pytest.raises(LanternError) as err:
        engine.generate(classes=list(np.arange(5000) % 10), **SETTINGS)
    assert "GiB, more than this machine can give" in one_line(err)
    with pytest.raises(LanternError) as err:
        engine.decode(np.zeros((100000, 36), dtype=np.int64))
    assert "decoding 100000 images needs" in one_line(err)
    assert backend.calls == 0  # refused before any work
    engine.memory_limit = None
    assert engine.decode(np.zeros((20, 36), dtype=np.int64)).shape == (20, 24, 24, 3)  # in chunks of 8
    assert backend.calls > 0  # the count sees work when there is some


def test_cgroup_limits_v1_and_v2(tmp_path):
    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    v2 = tmp_path / "v2"
    write(v2 / "cgroup.controllers", "cpu memory\n")
    write(v2 / "memory.max", "max\n")
    write(v2 / "box" / "memory.max", f"{4 << 30}\n")
    write(v2 / "box" / "memory.current", f"{1 << 30}\n")
    write(v2 / "box" / "job" / "memory.max", "max\n")
    write(v2 / "box" / "job" / "memory.current", f"{1 << 29}\n")
    proc = tmp_path / "cgroup-v2"
    write(proc, "0::/box/job\n")
    assert cgroup_headroom(v2, proc) == 3 << 30  # the ancestor's limit binds
    write(v2 / "box" / "job" / "memory.max", f"{1 << 30}\n")
    assert cgroup_headroom(v2, proc) == 1 << 29
    write(proc, "0::/\n")
    assert cgroup_headroom(v2, proc) is None  # the root has no limit

    v1 = tmp_path / "v1"
    write(v1 / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # "unlimited"
    write(v1 / "memory" / "memory.usage_in_bytes", "1000\n")
    proc1 = tmp_path / "cgroup-v1"
    write(proc1, "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_headroom(v1, proc1) is None
    write(v1 / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{2 << 30}\n")
    write(v1 / "memory" / "docker" / "abc" / "memory.usage_in_bytes", f"{1 << 30}\n")
    assert cgroup_headroom(v1, proc1) == 1 << 30
    write(v1 / "memory" / "memory.limit_in_bytes", f"{1 << 29}\n")  # a namespaced mount: own group as root
    assert cgroup_headroom(v1, proc1) == (1 << 29) - 1000

    meminfo = tmp_path / "meminfo"
    write(meminfo, "MemTotal: 100 kB\nMemAvailable: 8388608 kB\n")  # 8 GiB free on the host
    assert available_memory(meminfo, v1, proc1) == (1 << 29) - 1000  # the container's limit wins
    assert available_memory(meminfo, tmp_path / "none", tmp_path / "none") == 8 << 30


def test_positions_and_ids_past_the_model_are_refused_before_any_work(chameleon_engines):
    for family, d in chameleon_engines.items():
        backend = CountingBackend(Engine(d, threads=1).backend)
        engine = Engine(d, backend=backend)
        m = engine.manifest
        with pytest.raises(LanternError) as err:
            engine.generate(prompt_ids=np.full(m.max_positions, 5, dtype=np.int64), mode="ar")
        assert "positions" in one_line(err) and f"the model has {m.max_positions}" in one_line(err)
        with pytest.raises(LanternError) as err:
            engine.generate(prompt_ids=[5, 6, m.vocabulary.size], mode="ar")
        assert f"prompt id {m.vocabulary.size} is outside the engine's vocabulary" in one_line(err)
        if family == "lumina_mgpt":
            for grid in ((80, 80), (1000, 1000)):
                with pytest.raises(LanternError) as err:
                    engine.generate(prompt_ids=[5, 6], grid=grid, mode="ar")
                assert f"{grid[0]}x{grid[1]} grid" in one_line(err)
        assert backend.calls == 0, family  # refused before any work
        h, w = m.image.grid_height, m.image.grid_width
        engine.generate(prompt_ids=[5, 6], mode="ar", greedy=True, grid=(h, w) if family == "lumina_mgpt" else None)
        assert backend.calls > 0


# ---------------------------------------------------------------------------------------------
# One line for every reachable error


def test_deeply_nested_json_is_one_line(c2i_engine, tmp_path):
    d = copy(c2i_engine, tmp_path)
    m = json.loads(open(os.path.join(d, "manifest.json")).read())
    for depth in (100, 100000):
        text = json.dumps(m)[:-1] + ', "model_extra": ' + "[" * depth + "]" * depth + "}"
        open(os.path.join(d, "manifest.json"), "w").write(text)
        with pytest.raises(LanternError) as err:
            read_manifest(d)
        assert "nested deeper than" in one_line(err)
        tree = tmp_path / "tree.json"
        tree.write_text("[" * depth + "]" * depth)
        with pytest.raises(LanternError) as err:
            build_tree(str(tree))
        assert "nested deeper than" in one_line(err)


def test_decode_refuses_codes_outside_the_codebook(c2i_engine):
    engine = Engine(c2i_engine, threads=1)
    for codes, words in ((np.full((1, 36), 64), "code 64 is outside the codebook (0..63)"),
                         (np.full((1, 36), -1), "code -1 is outside"), (np.zeros((1, 35)), "integer VQ codes"),
                         (np.zeros((1, 37), dtype=np.int64), "[N, 36]")):
        with pytest.raises(LanternError) as err:
            engine.decode(codes)
        assert words in one_line(err)


# ---------------------------------------------------------------------------------------------
# Threads, and saying what ran


def test_threads_sharing_an_engine_are_serialised(c2i_engine):
    engine = Engine(c2i_engine, threads=1)
    requests = [dict(classes=[i % 10, (i + 3) % 10], seed=i, **SETTINGS) for i in range(4)]
    alone = [engine.generate(**r).tokens for r in requests]
    results, errors = [None] * len(requests), []

    def work(i):
        try:
            results[i] = engine.generate(**requests[i]).tokens
            engine.decode(results[i])
        except Exception as e:  # noqa: BLE001 - any failure in a thread is the finding
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert errors == [] and all(np.array_equal(a, b) for a, b in zip(alone, results))


def test_a_tuned_choice_is_said_in_the_summary_and_stats(c2i_engine, report, tmp_path, capsys):
    d = copy(c2i_engine, tmp_path)
    settings = GenerationSettings(mode="exact", greedy=True)
    tune_record.install(d, {1: root_only()}, {**report, "key": settings.key, "settings": settings.canonical()})
    assert run_main(["generate", d, "--mode", "exact", "--greedy", "--classes", "1", "--threads", "1",
                     "--out", str(tmp_path / "out")]) == 0
    tree_line, line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "mode ar (AR, tuned for mode exact with these settings)" in line
    assert tree_line.startswith("tree ar: tuned by `lantern-run tune`") and "batch 1 (AR was fastest)" in tree_line
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert (stats["mode"], stats["requested_mode"], stats["tree_source"]) == ("ar", "exact", "tuned")
    assert stats["tree_reason"] in tree_line
    # an explicit tree wins over the tuned one, on the CLI and in the API, and says so
    assert run_main(["generate", d, "--mode", "exact", "--greedy", "--classes", "1", "--threads", "1",
                     "--tree", "chain-1", "--out", str(tmp_path / "given")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-3] == "tree chain-1: given for this call"
    # the engine has no step graphs for that tree: its step ran on the host, and the last line says how to add them
    assert printed[-1].startswith("the step ran on the host: the engine has no step graphs for tree chain-1") and \
        "lantern-export accept" in printed[-1] and "--tree" in printed[-1]
    out = Engine(d, threads=1).generate(classes=[1], mode="exact", greedy=True, tree="chain-1")
    assert (out.stats["tree_source"], out.stats["tree"]) == ("given", "chain-1")
    # other settings were not tuned: the exported tree, said so
    out = Engine(d, threads=1).generate(classes=[1], mode="lantern++", lam=2.0, greedy=True)
    assert (out.stats["tree_source"], out.stats["tree"]) == ("exported", Engine(d).tree.name)
    assert out.stats["tree_reason"].startswith("exported with the engine")


@pytest.mark.parametrize("location", ["unlisted.bin", "../outside.bin"])
def test_external_data_the_manifest_does_not_list_is_refused(c2i_engine, tmp_path, location):
    onnx = pytest.importorskip("onnx")
    from lantern.runtime.integrity import sha256_file as sha256

    d = copy(c2i_engine, tmp_path)
    model = onnx.load(os.path.join(d, "target.onnx"))
    onnx.save_model(model, os.path.join(d, "scratch.onnx"), save_as_external_data=True, location="weights.bin",
                    size_threshold=0)
    os.replace(os.path.join(d, "weights.bin"), os.path.join(d, location))
    model = onnx.load(os.path.join(d, "scratch.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(model, os.path.join(d, "target.onnx"))
    os.remove(os.path.join(d, "scratch.onnx"))
    m = json.loads(open(os.path.join(d, "manifest.json")).read())  # the manifest agrees on target.onnx itself
    m["files"]["target.onnx"] = {"size": os.path.getsize(os.path.join(d, "target.onnx")),
                                 "sha256": sha256(os.path.join(d, "target.onnx"))}
    open(os.path.join(d, "manifest.json"), "w").write(json.dumps(m))
    with pytest.raises(LanternError) as err:
        Engine(d, threads=1)
    assert f"reads external data from {location!r}, which the manifest does not list" in one_line(err)
