"""The HTTP front of `lantern-run serve`: the one socket the service listens on, in the process
that runs the command, in front of the Ray Serve deployment (lantern.tools.serve_app), which it
calls through a deployment handle (Ray's own HTTP proxy is not started).

What reaches a replica has passed here first, in this order, each refusal one JSON line:
  head     request line and headers at most MAX_HEAD_BYTES (h11 stops reading past it, so a huge
           header costs no memory: 400) and MAX_HEADERS headers (431), before any key is checked
  route    404 / 405; GET /healthz needs no key and says only ok, busy or why the engine is down
  key      401 (constant-time compare)
  body     Content-Length over the limit: 413 at once; the whole body within body_timeout_s or
           408 (a slow client holds a coroutine here, never a replica slot)
  capacity a full queue (Ray's max_queued_requests): 503 with Retry-After
Every response has one x-request-id: the client's if it is 1-64 of [A-Za-z0-9._-], else a new one,
so a forged id never reaches a log line. A client that disconnects cancels its request in the
replica (its generate call stops between steps once all its clients are gone).
"""
import asyncio
import hmac
import json
import logging
import re
import threading
import time
import uuid

MAX_HEAD_BYTES = 16 * 1024  # request line + headers (a bearer key and a few proxies' headers fit easily)
MAX_HEADERS = 64
RETRY_AFTER_S = 1
ROUTES = {"/healthz": ("GET", "health"), "/v1/engine": ("GET", "engine_info"), "/v1/images": ("POST", "images")}
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._-]{1,64}")
logger = logging.getLogger("lantern.serve")


class Gone(Exception):
    """The client disconnected: nobody to answer."""


class Refused(Exception):
    """A request answered with an error before it reaches a replica."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def error(status, message):
    return status, "application/json", json.dumps({"error": message}).encode()


def request_id(headers):
    """The client's x-request-id if it is one short plain token, else a new one (raw ASGI headers)."""
    given = [value for name, value in headers if name.lower() == b"x-request-id"]
    if len(given) == 1 and _REQUEST_ID.fullmatch(given[0]):
        return given[0].decode()
    return uuid.uuid4().hex


def authorized(headers, key):
    """key: bytes or None (no key configured). Bearer token or x-api-key, compared in constant time."""
    if key is None:
        return True
    given = b""
    for name, value in headers:
        name = name.lower()
        if name == b"x-api-key":
            given = value
        elif name == b"authorization" and value[:7].lower() == b"bearer ":
            given = value[7:].strip()
    return hmac.compare_digest(given, key)


def route(method, path):
    """(the deployment method a request calls) or raise Refused 404 / 405."""
    entry = ROUTES.get(path.rstrip("/") or "/")
    if entry is None:
        raise Refused(404, "no such route; routes: " + ", ".join(f"{m} {p}" for p, (m, _) in ROUTES.items()))
    if method != entry[0]:
        raise Refused(405, f"this route takes {entry[0]}")
    return entry[1]


def _header(headers, wanted):
    return next((value for name, value in headers if name.lower() == wanted), None)


async def read_body(receive, headers, limit, timeout_s):
    """The request body (ASGI), refused past `limit` bytes (413) or `timeout_s` seconds (408)."""
    declared = _header(headers, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(413, f"request body is {int(declared)} bytes; the limit is {limit}")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Gone
                body += message.get("body", b"")
                if len(body) > limit:
                    raise Refused(413, f"request body exceeds the limit of {limit} bytes")
                if not message.get("more_body"):
                    return bytes(body)
    except TimeoutError:
        raise Refused(408, f"the request body did not arrive within {timeout_s:g} s") from None


async def _until_disconnect(receive):
    while (await receive())["type"] != "http.disconnect":
        pass


class Front:
    """The ASGI application: checks, then the deployment's health / engine_info / images."""

    def __init__(self, handle, api_key=None, max_body_bytes=4 * 2**20, body_timeout_s=20.0, health_timeout_s=5.0):
        self.handle = handle
        self.key = api_key.encode() if api_key else None
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.health_timeout_s = health_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan is off; no websockets
            return
        rid = request_id(scope["headers"])
        start = time.perf_counter()
        try:
            answer = await self._answer(scope, receive, rid)
        except Refused as e:
            answer = error(e.status, str(e))
        except Gone:
            return
        status, kind, body = answer
        headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", rid.encode())]
        if status == 503:
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        if status >= 400:
            headers.append((b"connection", b"close"))  # an unread body must not become the next request
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        if status >= 500:
            logger.warning("request %s -> %d in %.3f s", rid, status, time.perf_counter() - start)

    async def _answer(self, scope, receive, rid):
        headers = scope["headers"]
        if len(headers) > MAX_HEADERS:
            raise Refused(431, f"{len(headers)} headers; the limit is {MAX_HEADERS}")
        # h11 stops an incomplete head at MAX_HEAD_BYTES; one that arrived whole in a read is checked here
        head = len(scope["raw_path"]) + len(scope["query_string"]) + sum(len(n) + len(v) for n, v in headers)
        if head > MAX_HEAD_BYTES:
            raise Refused(431, f"the request head is over {MAX_HEAD_BYTES} bytes")
        name = route(scope["method"], scope["path"])
        if name == "health":
            return await self._call("health", timeout_s=self.health_timeout_s)
        if not authorized(headers, self.key):
            raise Refused(401, "missing or wrong API key")
        if name == "engine_info":
            return await self._call("engine_info")
        body = await read_body(receive, headers, self.max_body_bytes, self.body_timeout_s)
        return await self._call("images", body, rid, receive=receive)

    async def _call(self, method, *args, receive=None, timeout_s=None):
        """A deployment method's (status, content type, body); cancelled in the replica when the
        client disconnects (receive given) or the timeout passes."""
        from ray.serve.exceptions import BackPressureError

        response = getattr(self.handle, method).remote(*args)

        async def result():
            return await response

        answer = asyncio.ensure_future(result())
        gone = asyncio.ensure_future(_until_disconnect(receive)) if receive is not None else None
        try:
            done, _ = await asyncio.wait({answer} | ({gone} if gone else set()), timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if gone is not None:
                gone.cancel()
        if answer not in done:
            response.cancel()
            answer.cancel()
            if gone is not None and gone in done:
                raise Gone
            return error(503, f"no replica answered within {timeout_s:g} s")
        try:
            return answer.result()
        except BackPressureError:
            return error(503, "the server is at capacity; retry later")
        except Exception as e:  # noqa: BLE001 -- a replica that died or failed; the log has the details
            logger.error("%s failed in the deployment: %s: %s", method, type(e).__name__, e)
            return error(500, "the request failed in the server")


def h11_protocol():
    """uvicorn's h11 protocol, with its refusal of a malformed or oversized request head as one
    JSON line (uvicorn's own is plain text)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def send_400_response(self, msg):
            _, kind, body = error(400, f"malformed HTTP request, or a request head over {MAX_HEAD_BYTES} bytes")
            for event in (h11.Response(status_code=400, headers=[(b"content-type", kind), (b"connection", b"close")]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol


class FrontServer:
    """The front on host:port in a thread of its own (uvicorn, h11, no server header)."""

    def __init__(self, app, host, port):
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, http=h11_protocol(),
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES, lifespan="off", access_log=False,
                                log_level="warning", server_header=False, date_header=False, timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="lantern-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP front could not listen on {host}:{port}")
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]  # port 0: the one the system chose

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
