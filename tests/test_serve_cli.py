"""`lantern-run serve` and `lantern-run client` as the commands a user runs (test_serve.py drives
the Ray Serve app from Python): the server is a subprocess on loopback with its own Ray temp
directory, the client a subprocess whose files must equal `Engine.generate` of the same request;
a wrong key is one line and a non-zero exit; Ctrl-C stops the server and every Ray process it
started. One server for the file, stopped even when a test fails."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (the dev and serve extras hold it)")

from lantern.runtime.errors import LanternError  # noqa: E402
from lantern.runtime.generator import Engine  # noqa: E402
from lantern.runtime.settings import GenerationSettings  # noqa: E402
from lantern.tools.serve_client import request  # noqa: E402

KEY = "cli-test-key-0123456789abcdef"
LANTERN_RUN = [sys.executable, "-m", "lantern.tools.run_cli"]
START_S, STOP_S = 180, 90  # bounds on a loaded 2-core machine; an idle one starts in ~8 s and stops in ~7 s


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_of(server_pid, ray_tmp):
    """Live processes the server started: its session (start_new_session makes the server its
    leader) or anything running from its Ray temp directory. Nobody else's."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z" and (int(fields[3]) == server_pid or ray_tmp in cmdline):
            found.append(int(entry))
    return found


def stop(proc, ray_tmp):
    """Ctrl-C the server (Serve drains, Ray shuts down), wait for its processes to go; kill
    what is left of them. Returns (exit code, pids that had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 30
    while (left := processes_of(proc.pid, ray_tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    return proc.wait(timeout=30), left


def served(log_path):
    """The command's `serving ...` line: its options as JSON, or None before it is printed."""
    line = next((s for s in log_path.read_text().splitlines() if s.startswith("serving ")), None)
    return line and json.loads(line[line.index("(") + 1: line.rindex(")")])


@pytest.fixture(scope="module")
def server(c2i_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-cli")
    (root / "key.txt").write_text(KEY + "\n")
    # Ray's own directory, short (its socket paths must fit 107 bytes) and ours alone: no
    # RAY_ADDRESS, so it starts a cluster of its own instead of joining another session's
    ray_tmp = tempfile.mkdtemp(prefix="lantern-ray-")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    port = free_port()
    log_path = root / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(LANTERN_RUN + ["serve", c2i_engine, "--host", "127.0.0.1", "--port", str(port),
                                               "--api-key-file", str(root / "key.txt"), "--num-cpus", "2",
                                               "--threads", "1", "--max-batch", "4"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = {"url": f"http://127.0.0.1:{port}", "root": root, "proc": proc, "ray_tmp": ray_tmp, "log": log_path}
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, f"lantern-run serve exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            try:  # up: /healthz answers and the command has said what it serves
                health = request(server["url"] + "/healthz", timeout=5)
                if health[0] == 200 and served(log_path):
                    break
            except LanternError as e:  # not listening yet
                health = e
            assert time.monotonic() < deadline, \
                f"not serving in {START_S} s (/healthz: {health}):\n{log_path.read_text()[-3000:]}"
            time.sleep(0.5)
        yield server
    finally:
        stop(proc, ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(c2i_engine):
    return Engine(c2i_engine, threads=1)


def client(server, *args, key=True):
    argv = LANTERN_RUN + ["client", server["url"], *args]
    if key:
        argv += ["--api-key-file", str(server["root"] / "key.txt")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_serve_options_reach_the_server(server):
    options = served(server["log"])
    assert (options["threads"], options["max_batch"]) == (1, 4)
    assert request(server["url"] + "/v1/engine")[0] == 401  # --api-key-file is in force
    status, described = request(server["url"] + "/v1/engine", api_key=KEY)
    assert status == 200 and described["batch_sizes"] == [1, 2, 4]  # --max-batch 4


@pytest.mark.parametrize("args, settings", [
    (["--mode", "lantern++", "--cfg-scale", "2", "--settings", '{"lam": 3, "k": 8}'],
     {"mode": "lantern++", "cfg_scale": 2.0, "lam": 3, "k": 8}),
    (["--mode", "exact", "--greedy"], {"mode": "exact", "greedy": True}),
], ids=["sampling-cfg", "greedy-exact"])
def test_client_files_equal_direct_generation(server, engine, tmp_path, args, settings):
    out = tmp_path / "out"
    done = client(server, "--classes", "2,6", "--n", "2", "--seed", "5", *args, "--out", str(out))
    assert done.returncode == 0, done.stderr
    # each condition n times in a row, image j seeded seed + j
    want = engine.generate(GenerationSettings(**settings), classes=[2, 2, 6, 6], seed=5).tokens
    assert (want != engine.generate(classes=[2, 2, 6, 6], seed=5).tokens).any()  # the options matter
    np.testing.assert_array_equal(np.load(out / "tokens.npy"), want)
    response = json.loads((out / "response.json").read_text())
    assert response["request_id"] in done.stdout and str(out) in done.stdout
    for i in range(4):
        assert (out / f"image_{i:03d}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_client_with_a_wrong_key_is_one_line(server, tmp_path):
    (tmp_path / "wrong.txt").write_text("wrong-key-0123456789abcdef\n")
    out = tmp_path / "out"
    done = client(server, "--classes", "2", "--api-key-file", str(tmp_path / "wrong.txt"), "--out", str(out), key=False)
    assert done.returncode == 2 and "401" in done.stderr and "API key" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not out.exists()


def test_ctrl_c_stops_the_server_and_its_ray_processes(server):
    """Last in the file: stops the module's server (the fixture's finalizer then finds it gone)."""
    pid = server["proc"].pid
    assert set(processes_of(pid, server["ray_tmp"])) - {pid}  # the check sees Ray's processes
    code, killed = stop(server["proc"], server["ray_tmp"])
    assert code == 0 and killed == [], server["log"].read_text()[-3000:]
    with pytest.raises(LanternError, match="cannot reach"):
        request(server["url"] + "/healthz", timeout=5)


@pytest.mark.parametrize("args, says", [
    (["--max-batch", "100000"], "for 100000 image(s) with CFG needs about"),  # one replica's widest plan
    (["--max-batch", "64", "--replicas", "5000"], "5000 replicas' plans of"),  # every replica holds one
])
def test_serve_refuses_what_the_machine_cannot_hold_before_ray_starts(c2i_engine, monkeypatch, capsys, args, says):
    """`lantern-run serve` refuses up front, in one line with the estimate, replicas whose step
    plans this machine cannot hold (as generate refuses a plan), before any Ray process starts."""
    import ray

    from lantern.tools import run_cli, serve

    monkeypatch.setattr(serve, "available_memory", lambda: 2**30)  # this machine, as the reader would report it

    def start(*args, **kwargs):
        raise AssertionError("the server started: nothing refused it")

    monkeypatch.setattr(serve, "start", start)
    assert run_cli.main(["serve", c2i_engine, "--port", "0", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "1.00 GiB available" in lines[0], lines
    assert captured.out == "" and not ray.is_initialized()
