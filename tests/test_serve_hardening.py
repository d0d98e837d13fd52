"""`lantern-run serve` against hostile and unlucky clients (loopback only): Ray's ports on the
loopback, slow bodies, huge and many headers, deep JSON and out-of-range numbers, a full queue,
forged request ids, tuned trees changed or deleted under the server, and a replica restarting
over a damaged engine. One server for the file, started as the command an operator runs (a
subprocess, so its sockets, memory and log are its own), stopped at the end."""
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (the dev and serve extras hold it)")

from lantern.runtime.generator import Engine  # noqa: E402
from lantern.runtime.manifest import describe_files, read_manifest, TunedSettings, TunedTree  # noqa: E402
from lantern.runtime.settings import GenerationSettings  # noqa: E402
from lantern.runtime.tree import build_tree  # noqa: E402
from lantern.tools.image_service import ImageService, RequestError  # noqa: E402
from lantern.tools.bench.serve import process_family  # noqa: E402

KEY = "hardening-key-0123456789"
MAX_BATCH, MAX_QUEUED, BODY_TIMEOUT_S = 4, 2, 3
TUNED = {"mode": "lantern++", "lam": 3.0, "k": 8, "greedy": True}  # the settings given a tuned tree here


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_tuned_tree(directory, settings, tree, images):
    """A tuned-tree entry as `lantern-run tune` records one (the tree file, its hash in the
    manifest), without the tuning run and its report."""
    m = read_manifest(directory)
    file = f"tuned/{settings.key}.b{images}.json"
    os.makedirs(os.path.join(directory, "tuned"), exist_ok=True)
    with open(os.path.join(directory, file), "w") as f:
        json.dump(tree.to_json(), f)
    entry = TunedSettings(settings=settings, backend="onnxruntime", measured={},
                          trees=(TunedTree(images=images, file=file, name=tree.name, nodes=tree.num_nodes,
                                           depth=tree.depth, predicted={}),))
    files = {**m.files, **describe_files(directory, [file])}
    m.replace(tuned_trees={settings.key: entry}, files=files).write(directory)
    return file


class Server:
    def __init__(self, engine_dir, log_path):
        self.engine_dir, self.port = engine_dir, free_port()
        key_file = os.path.join(os.path.dirname(log_path), "key.txt")
        with open(key_file, "w") as f:
            f.write(KEY)
        self.log = open(log_path, "w+")
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lantern.tools.run_cli", "serve", str(engine_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--api-key-file", key_file, "--threads", "1", "--num-cpus", "2",
             "--max-batch", str(MAX_BATCH), "--max-queued-requests", str(MAX_QUEUED),
             "--body-timeout-s", str(BODY_TIMEOUT_S)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            try:
                if self.call("GET", "/healthz", timeout=10)[0] == 200:
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.output()[-3000:]}")
            time.sleep(1)

    def call(self, method, path, body=None, headers=None, key=KEY, timeout=60):
        """(status, headers as a list of (lowercase name, value), body: JSON object or bytes)."""
        h = dict(headers or {})
        if key:
            h["authorization"] = f"Bearer {key}"
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            c.request(method, path, body=json.dumps(body).encode() if isinstance(body, dict) else body, headers=h)
            r = c.getresponse()
            data = r.read()
            answer_headers = [(k.lower(), v) for k, v in r.getheaders()]
            kind = dict(answer_headers).get("content-type", "")
            return r.status, answer_headers, json.loads(data) if kind.startswith("application/json") else data
        finally:
            c.close()

    def images(self, payload, **kw):
        return self.call("POST", "/v1/images", payload, **kw)

    def pids(self):
        """The server's process and every descendant (Ray's processes and workers)."""
        return process_family(self.process.pid)

    def output(self):
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self):
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def engine_dir(c2i_engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening") / "engine"
    shutil.copytree(c2i_engine, d)
    settings = GenerationSettings(**TUNED)
    install_tuned_tree(d, settings, build_tree("chain-2", name="tuned-chain-2"), MAX_BATCH)
    return d


@pytest.fixture(scope="module")
def server(engine_dir):
    s = Server(engine_dir, str(engine_dir.parent / "server.log"))
    yield s
    s.stop()


def listening(pids):
    """{(address, port)} of the TCP sockets the processes listen on (from /proc, no tools needed)."""
    inodes = {}
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    address, port = fields[1].split(":")
                    inodes[fields[9]] = (address, int(port, 16))
    found = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    found.add(inodes[target[8:-1]])
        except OSError:
            pass  # a process that ended meanwhile
    return found


# /proc/net addresses: hex, little-endian words; loopback as IPv4 and IPv4-mapped or ::1 as IPv6
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def test_every_port_of_a_loopback_server_is_on_the_loopback(server):
    sockets = listening(server.pids())
    assert (("0100007F", server.port)) in sockets  # the front, found the way the others are
    assert len(sockets) > 5  # gcs, raylet, workers, agents: the check sees Ray's ports too
    exposed = sorted(s for s in sockets if s[0] not in LOOPBACK)
    assert not exposed, exposed


def test_routes_without_a_key_reveal_nothing(server, engine_dir):
    status, headers, body = server.call("GET", "/healthz", key=None)
    assert (status, body) == (200, {"status": "ok"})
    names = [name for name, _ in headers]
    assert "server" not in names and names.count("x-request-id") == 1
    for path in ("/-/routes", "/-/healthz", "/v1/engine", "/"):
        status, headers, body = server.call("GET", path, key=None)
        assert status in (401, 404) and set(body) == {"error"}, (path, body)
        assert "ray" not in json.dumps(body).lower() and str(engine_dir) not in json.dumps(body)
    status, _, described = server.call("GET", "/v1/engine")
    assert status == 200 and str(engine_dir) not in json.dumps(described)


def test_slow_bodies_hold_no_slot_and_are_cut_at_the_deadline(server):
    head = (f"POST /v1/images HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n{{").encode()
    slow = []
    try:
        for _ in range(24):  # far more than the replica's 2 * MAX_BATCH slots and MAX_QUEUED queue
            s = socket.create_connection(("127.0.0.1", server.port), timeout=BODY_TIMEOUT_S + 30)
            s.sendall(head)
            slow.append(s)
        t = time.monotonic()
        status, _, body = server.images({"classes": [1], "settings": {"mode": "exact", "greedy": True}}, timeout=30)
        assert status == 200, body
        assert time.monotonic() - t < BODY_TIMEOUT_S + 10  # generous: not after the slow ones gave up
        answer = read_answer(slow[0])  # the server answers once the deadline passed
        assert answer.startswith("HTTP/1.1 408") and "did not arrive within" in answer, answer
    finally:
        for s in slow:
            s.close()


def read_answer(sock):
    """One whole HTTP response from a raw socket: head and body can arrive in separate reads; a
    body without Content-Length ends when the server closes."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head) if sep else None
        if length is not None and len(body) >= int(length.group(1)):
            return data.decode()
        chunk = sock.recv(4096)
        if not chunk:
            return data.decode()
        data += chunk


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def huge_header(port, size):
    """Send a request whose one header is `size` bytes: the answer's status line, or how it ended."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(b"GET /v1/engine HTTP/1.1\r\nHost: x\r\nX-Big: ")
            chunk = b"a" * 2**20
            for _ in range(size // len(chunk)):
                s.sendall(chunk)
            s.sendall(b"\r\n\r\n")
            return s.recv(4096).split(b"\r\n", 1)[0].decode()
        except (BrokenPipeError, ConnectionResetError):
            return "closed by the server"


def test_a_huge_header_is_refused_without_memory_growth(server):
    before = rss(server.process.pid)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        endings = list(pool.map(lambda _: huge_header(server.port, 32 * 2**20), range(8)))
    assert all(e in ("HTTP/1.1 400 Bad Request", "closed by the server") for e in endings), endings
    assert rss(server.process.pid) - before < 64 * 2**20  # 8 x 32 MB were never held
    # a head over the limit that arrives whole: refused before the key check, one JSON line
    status, _, body = server.call("GET", "/v1/engine", headers={"x-big": "a" * 20_000}, key=None)
    assert status == 431 and "request head is over" in body["error"]
    # one still arriving past the limit: h11 stops reading it, and the answer is JSON too
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
        answer = read_answer(s)
    assert answer.startswith("HTTP/1.1 400") and "request head over" in json.loads(answer.split("\r\n\r\n")[1])["error"]
    assert server.call("GET", "/healthz")[0] == 200


def test_too_many_headers_are_refused_before_the_key(server):
    status, _, body = server.call("GET", "/v1/engine", headers={f"x-h{i}": "1" for i in range(100)}, key=None)
    assert status == 431 and "headers" in body["error"]


@pytest.mark.parametrize("raw, words", [
    (b'{"classes": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested deeper"),
    (b'{"classes": [1], "settings": {"temperature": NaN}}', "not JSON"),
    (json.dumps({"classes": [1], "settings": {"top_k": 10**30}}).encode(), "top_k must be <="),
    (json.dumps({"classes": [1], "settings": {"temperature": 1e-308}}).encode(), "temperature must be in"),
    (json.dumps({"classes": [1], "settings": {"cfg_scale": 1e308}}).encode(), "cfg scale must be <="),
    (json.dumps({"classes": [1], "settings": {"mode": "lantern++", "lam": 1e300}}).encode(), "lam must be <="),
    (json.dumps({"classes": [1], "settings": {"top_p": 1e-308}}).encode(), "top_p must be >="),
    (json.dumps({"classes": [10**30]}).encode(), "class labels"),
    (json.dumps({"classes": [1], "settings": {"cfg_interval": 10**30}}).encode(), "cfg_interval must be <="),
])
def test_hostile_values_are_a_400_with_one_json_line(server, raw, words):
    status, headers, body = server.images(raw)
    assert status == 400 and words in body["error"] and "\n" not in body["error"], body


def test_a_full_queue_is_a_503_with_retry_after_and_json(server):
    payload = {"classes": [1, 2, 3, 4], "seed": 0, "settings": {"mode": "lantern++", "k": 8}}
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(lambda _: server.images(payload, timeout=120), range(24)))
    refused = [(headers, body) for status, headers, body in answers if status == 503]
    assert refused and {status for status, _, _ in answers} <= {200, 503}
    for headers, body in refused:
        assert dict(headers)["retry-after"] == "1" and "capacity" in body["error"]


def test_request_ids_are_one_clean_header_and_never_logged_as_given(server):
    forged = ["x" * 10_000, "abc def", "a\"b"]
    for given in forged:
        status, headers, _ = server.call("GET", "/healthz", headers={"x-request-id": given}, key=None)
        ids = [value for name, value in headers if name == "x-request-id"]
        assert status == 200 and len(ids) == 1 and ids[0] != given and 1 <= len(ids[0]) <= 64 and ids[0].isalnum()
        status, headers, _ = server.images({"classes": [1], "settings": {"mode": "exact", "greedy": True}},
                                           headers={"x-request-id": given})
        assert status == 200 and [v for n, v in headers if n == "x-request-id"] != [given]
    status, headers, body = server.images({"classes": [1], "settings": {"mode": "exact", "greedy": True}},
                                          headers={"x-request-id": "client-42.a"})
    assert status == 200 and dict(headers)["x-request-id"] == "client-42.a" == body["request_id"]
    deadline = time.monotonic() + 30
    while "client-42.a" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.5)  # replica log lines reach the driver's output a little later
    log = server.output()
    assert "request client-42.a -> 200" in log
    assert not any(given in log for given in forged)


def test_a_client_that_disconnects_cancels_its_request_in_the_replica(server):
    body = json.dumps({"classes": [1, 2, 3, 4], "settings": {"mode": "lantern++", "k": 8}}).encode()
    clients = []
    try:
        for i in range(2 * MAX_BATCH):  # more than one generate call's worth: some wait, and are cancelled
            head = (f"POST /v1/images HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-request-id: gone-{i}"
                    f"\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            clients.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
            clients[-1].sendall(head + body)
        # Held open until the replica has answered one of them, so the others are in it (a client
        # gone before the front read its body is never sent on, and nothing is cancelled); a
        # loaded machine's front can take seconds to get that far.
        deadline = time.monotonic() + 120
        while "request gone-" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for s in clients:
            s.close()
    deadline = time.monotonic() + 60
    while "cancelled by its client" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "cancelled by its client" in server.output()
    assert server.images({"classes": [1], "settings": {"mode": "exact", "greedy": True}})[0] == 200


def test_the_tuned_tree_is_the_one_read_at_start_whatever_happens_to_its_file(server, engine_dir):
    engine = Engine(engine_dir, threads=1)
    want = engine.generate(GenerationSettings(**TUNED), classes=[3], seed=9, tree=build_tree("chain-2")).tokens
    payload = {"classes": [3], "seed": 9, "settings": TUNED}

    def served():
        status, _, body = server.images(payload)
        assert status == 200, body
        return body["stats"]["tree"], np.array([im["tokens"] for im in body["images"]])

    tree, tokens = served()
    assert tree == "tuned-chain-2"
    np.testing.assert_array_equal(tokens, want)
    file = engine_dir / read_manifest(engine_dir).tuned_trees[GenerationSettings(**TUNED).key].trees[0].file
    file.write_text(json.dumps(build_tree("chain-5", name="replaced").to_json()))  # replaced under the server
    assert served()[0] == "tuned-chain-2"
    file.unlink()  # deleted, as re-running tune deletes the entry's old files
    tree, tokens = served()
    assert tree == "tuned-chain-2"
    np.testing.assert_array_equal(tokens, want)


def test_a_replica_restarting_over_a_damaged_engine_answers_503_with_the_reason_at_once(server, engine_dir):
    manifest = engine_dir / "manifest.json"
    good = manifest.read_bytes()
    manifest.write_bytes(b"{damaged")
    replicas = [pid for pid in server.pids() if b"ServeReplica" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert replicas
    for pid in replicas:
        os.kill(pid, signal.SIGKILL)  # Ray starts a new replica, which reads the damaged directory
    deadline = time.monotonic() + 120
    while True:
        try:
            status, headers, body = server.call("GET", "/healthz", key=None, timeout=30)
        except OSError:
            status = None
        if status == 503 and "cannot be opened" in body.get("error", "") or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert status == 503 and "manifest" in body["error"], body
    assert str(engine_dir) not in json.dumps(body)
    t = time.monotonic()
    status, headers, body = server.images({"classes": [1], "settings": {"mode": "exact", "greedy": True}}, timeout=30)
    assert status == 503 and "cannot be opened" in body["error"] and dict(headers)["retry-after"] == "1"
    assert time.monotonic() - t < 10 and str(engine_dir) not in json.dumps(body)
    manifest.write_bytes(good)  # repaired: the replica opens it again by itself
    deadline = time.monotonic() + 60
    while server.call("GET", "/healthz", key=None, timeout=30)[0] != 200 and time.monotonic() < deadline:
        time.sleep(1)
    assert server.images({"classes": [1], "settings": {"mode": "exact", "greedy": True}})[0] == 200


# -- the same checks in the service, without a server (cheap) ------------------------------------

@pytest.mark.parametrize("raw", [
    b'{"classes": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"classes": [1], "settings": {"cfg_scale": Infinity}}',
    json.dumps({"classes": [1], "settings": {"k": 10**30}}).encode(),
])
def test_the_service_refuses_what_would_overflow(c2i_engine, raw):
    service = ImageService(Engine(c2i_engine, threads=1), max_batch=2)
    with pytest.raises(RequestError) as e:
        service.parse(raw)
    assert e.value.status == 400 and "\n" not in str(e.value)
