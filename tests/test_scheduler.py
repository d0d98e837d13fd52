"""The serving scheduler (tools/scheduler.py: requests onto continuous batches) without Ray, on
tiny real engines: every request's images equal Engine.generate of that request alone, whatever
ran beside it (several settings keys taking turns, more keys than batches held, requests of
several images); cancelled requests leave; one request's failure is its own."""
import json
import threading
import time

import numpy as np
import pytest

from lantern.runtime.generator import DECODE_CHUNK, Engine
from lantern.runtime.plan import decode_bytes, estimate_bytes
from lantern.runtime.tree import build_tree, root_only
from lantern.tools.image_service import _concat, Cancelled, ImageService, RequestError
from lantern.tools.scheduler import MAX_BATCHES, Scheduler


@pytest.fixture(scope="module")
def service(c2i_engine):
    return ImageService(Engine(c2i_engine, threads=1), max_batch=4)


def parse(service, **body):
    return service.parse(json.dumps(body).encode())


def alone(service, request):
    return service.engine.generate(request.settings, **_concat([request.condition], 0), seed=request.seed,
                                   tree=service.tree_for(request)).tokens


def test_requests_of_several_keys_equal_their_generation_alone(service):
    modes = [{"mode": "lantern++", "k": 8}, {"mode": "exact", "greedy": True}, {"mode": "ar", "top_k": 30},
             {"mode": "exact", "proposer": "jacobi", "window": 3}, {"mode": "lantern++", "greedy": True, "k": 8}]
    assert len(modes) > MAX_BATCHES  # some key waits for a batch to drain
    requests = [parse(service, classes=[i % 10], seed=i, n=1 + i % 2, settings=modes[i % len(modes)])
                for i in range(15)]
    scheduler = Scheduler(service)
    try:
        futures = [scheduler.submit(r) for r in requests]
        results = [f.result(timeout=600) for f in futures]
    finally:
        scheduler.close()
    shared = []
    for request, result in zip(requests, results):
        assert not isinstance(result, Exception), result
        np.testing.assert_array_equal(result.tokens, alone(service, request))
        assert result.images.shape[0] == request.images  # decoded
        shared.append(result.stats["requested_images"])
    assert max(shared) > 1.5, shared  # images really ran side by side


def test_a_cancelled_request_leaves_and_the_others_finish(service):
    settings = {"mode": "lantern++", "greedy": True}
    requests = [parse(service, classes=[c], seed=c, settings=settings) for c in range(5)]
    scheduler = Scheduler(service)
    try:
        futures = [scheduler.submit(r) for r in requests]
        requests[1].cancelled.set()
        results = [f.result(timeout=600) for f in futures]
    finally:
        scheduler.close()
    for i, (request, result) in enumerate(zip(requests, results)):
        if i == 1:
            assert isinstance(result, Cancelled) or np.array_equal(result.tokens, alone(service, request))
        else:
            np.testing.assert_array_equal(result.tokens, alone(service, request))


def test_a_request_that_fails_fails_alone(c2i_engine):
    """A batch the replica's memory cannot hold (a wide jacobi window's dense q, under a memory
    limit between its need and AR's) fails when it starts: that request gets a 503 with the
    reason, the others are served."""
    engine = Engine(c2i_engine, threads=1)
    service = ImageService(engine, max_batch=2)
    wide = parse(service, classes=[1], settings={"mode": "exact", "proposer": "jacobi", "window": 17,
                                                           "cfg_scale": 3.0})
    fine = [parse(service, classes=[c], seed=c, settings={"mode": "ar", "greedy": True, "cfg_scale": 3.0})
            for c in (2, 3, 4)]
    prefix = engine.condition.prefix(True, classes=[1, 1])
    need = [estimate_bytes(engine.manifest, tree, prefix, 4, drafter=False) for tree in (root_only(), build_tree("chain-16"))]
    decode = decode_bytes(engine.manifest, 1, DECODE_CHUNK)  # a request's image is decoded under the limit too
    engine.memory_limit = max(need[0], decode) * 1.05 / 0.8  # check_memory keeps 20% for everything else
    assert need[1] > 0.8 * engine.memory_limit, (need, decode)
    scheduler = Scheduler(service)
    try:
        futures = [scheduler.submit(r) for r in [fine[0], wide] + fine[1:]]
        results = [f.result(timeout=600) for f in futures]
    finally:
        scheduler.close()
    assert isinstance(results[1], RequestError) and results[1].status == 503
    assert "GiB" in str(results[1]) and c2i_engine not in str(results[1])
    for request, result in zip(fine, results[:1] + results[2:]):
        np.testing.assert_array_equal(result.tokens, alone(service, request))


def test_an_idle_scheduler_waits_without_spinning(service):
    scheduler = Scheduler(service)
    try:
        start = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - start < 0.2  # the worker blocks on its inbox
        assert scheduler.thread.is_alive() and threading.active_count() >= 2
    finally:
        scheduler.close()
    assert not scheduler.thread.is_alive()


def test_a_prompt_past_the_models_positions_is_refused_at_parse(chameleon_engines):
    """A client's prompt and grid the model has no positions for is the client's error (400),
    found before it is queued, not a server failure when its batch starts."""
    service = ImageService(Engine(chameleon_engines["lumina_mgpt"], threads=1), max_batch=2)
    limit = service.engine.manifest.max_positions
    with pytest.raises(RequestError) as e:
        parse(service, prompt_ids=[5] * (limit - 4), grid=[4, 4])
    assert e.value.status == 400 and "positions" in str(e.value) and "\n" not in str(e.value)
    parse(service, prompt_ids=[5, 6], grid=[4, 4])  # a short one is fine


def test_keys_take_turns(service):
    """A request of another settings key that arrives behind many of one key runs beside them,
    a step at a time, instead of waiting for them all."""
    many = [parse(service, classes=[c % 10], seed=c, settings={"mode": "ar", "greedy": True}) for c in range(16)]
    other = parse(service, classes=[3], seed=1, settings={"mode": "exact", "greedy": True})
    done = {}
    scheduler = Scheduler(service, slots=2)  # 16 requests of the first key: 8 rounds of its batch
    try:
        futures = [scheduler.submit(r) for r in many + [other]]
        for i, f in enumerate(futures):
            f.add_done_callback(lambda _, i=i: done.setdefault(i, len(done)))
        [f.result(timeout=600) for f in futures]
    finally:
        scheduler.close()
    assert done[len(many)] < len(many) // 2, done  # the other key's request finished among the first half
    np.testing.assert_array_equal(futures[-1].result().tokens, alone(service, other))


def test_a_future_cannot_be_cancelled_from_outside(service):
    """asyncio.wrap_future cancels the scheduler's future when a client goes away; the future is
    running from submit on, so that cancel is refused and answering it never raises in the worker
    (which once failed every request of the key, some never answered)."""
    requests = [parse(service, classes=[c], seed=c, settings={"mode": "ar", "greedy": True}) for c in range(3)]
    scheduler = Scheduler(service)
    try:
        futures = [scheduler.submit(r) for r in requests]
        assert not any(f.cancel() for f in futures)
        results = [f.result(timeout=600) for f in futures]
    finally:
        scheduler.close()
    for request, result in zip(requests, results):
        np.testing.assert_array_equal(result.tokens, alone(service, request))
