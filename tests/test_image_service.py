"""The serving logic without Ray: requests parsed and checked, grouped by settings key, padded to
the engine's batch sizes and split back, each image equal to a direct Engine.generate."""
import dataclasses
import json
import threading

import numpy as np
import pytest

from lantern.runtime.generator import Engine
from lantern.tools.image_service import Cancelled, ImageService, RequestError


@pytest.fixture(scope="module")
def service(c2i_engine):
    return ImageService(Engine(c2i_engine, threads=1), max_batch=4)


def body(**fields):
    return json.dumps(fields).encode()


def direct(service, request):
    """The same request as one Engine.generate call on an engine of its own."""
    engine = Engine(service.engine.directory, threads=1)
    return engine.generate(request.settings, **request.condition, seed=request.seed,
                           tree=service.tree_for(request)).tokens


@pytest.mark.parametrize("mode", ["exact", "lantern++"])
def test_batched_greedy_images_equal_direct_generation(service, mode):
    requests = [service.parse(body(classes=[c], seed=c, settings={"mode": mode, "greedy": True, "lam": 3, "k": 8}))
                for c in (0, 5, 9)]
    assert len(service.calls(requests)) == 1  # one key: one generate call, padded 3 -> 4 images
    results = service.run(requests)
    assert [r.stats["batch_images"] for r in results] == [4, 4, 4]
    for request, result in zip(requests, results):
        assert result.tokens.shape == (1, 36) and result.images.shape[0] == 1
        np.testing.assert_array_equal(result.tokens, direct(service, request))


def test_sampling_images_equal_direct_generation_whatever_else_is_queued(service):
    settings = {"mode": "lantern++", "lam": 2, "k": 8, "temperature": 1.0, "cfg_scale": 2.0}
    mine = service.parse(body(classes=[1, 2], seed=11, settings=settings))
    others = [service.parse(body(classes=[c], seed=0, settings=settings)) for c in (3, 4)]
    alone = service.run([mine])[0].tokens
    results = service.run([others[0], mine, others[1]])
    assert [r.stats["batch_images"] for r in results] == [4, 4, 4]  # one call, each image its own stream
    np.testing.assert_array_equal(alone, direct(service, mine))
    np.testing.assert_array_equal(results[1].tokens, alone)
    np.testing.assert_array_equal(results[2].tokens, direct(service, others[1]))
    assert not np.array_equal(alone[0], alone[1])  # two images of one request are two draws


def test_jacobi_requests_are_served_as_direct_generation(service):
    """The drafter-free proposer through the service: batched sampling images equal each
    request alone, and greedy jacobi exact gives AR's tokens."""
    jacobi = {"mode": "lantern++", "lam": 2, "k": 8, "cfg_scale": 2.0, "proposer": "jacobi", "window": 6}
    requests = [service.parse(body(classes=[c], seed=c, settings=jacobi)) for c in (0, 5, 9)]
    assert len(service.calls(requests)) == 1
    for request, result in zip(requests, service.run(requests)):
        assert result.stats["proposer"] == "jacobi" and result.stats["window"] == 6
        np.testing.assert_array_equal(result.tokens, direct(service, request))
    greedy = [service.parse(body(classes=[3], seed=1, settings={"mode": mode, "greedy": True, "proposer": "jacobi"}))
              for mode in ("exact", "ar")]
    exact, ar = service.run(greedy)
    np.testing.assert_array_equal(exact.tokens, ar.tokens)
    assert exact.stats["steps_per_image"] < ar.stats["steps_per_image"]


def test_a_call_never_mixes_settings_and_never_exceeds_the_max_batch(service):
    greedy = {"mode": "exact", "greedy": True}
    requests = [service.parse(body(classes=[0, 1, 2], settings=greedy)),
                service.parse(body(classes=[3], settings={"mode": "ar", "greedy": True})),
                service.parse(body(classes=[4, 5], settings=greedy)),
                service.parse(body(classes=[6], settings=greedy))]
    calls = service.calls(requests)
    assert [[requests.index(r) for r in call] for call in calls] == [[0], [2, 3], [1]]
    for call in calls:
        assert len({r.key for r in call}) == 1 and sum(r.images for r in call) <= service.max_batch
    results = service.run(requests)
    assert [r.stats["mode"] for r in results] == ["exact", "ar", "exact", "exact"]
    assert [r.tokens.shape[0] for r in results] == [3, 1, 2, 1]
    assert service.padded_size(3) == 4 and service.sizes == (1, 2, 4)


def test_n_repeats_each_condition(service):
    request = service.parse(body(classes=[7, 8], n=2, settings={"mode": "exact", "greedy": True}))
    assert request.images == 4 and request.condition["classes"] == [7, 7, 8, 8]
    tokens = service.run([request])[0].tokens
    np.testing.assert_array_equal(tokens[0], tokens[1])  # greedy: the same class gives the same image
    assert not np.array_equal(tokens[1], tokens[2])


@pytest.mark.parametrize("raw, status, words", [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (body(classes=[1], colour="red"), 400, "unknown request field"),
    (body(classes=[1], settings={"mode": "lantern++", "beam": 4}), 400, "unknown setting"),
    (body(classes=[1], settings={"mode": "beam"}), 400, "unknown mode"),
    (body(classes=[1], settings={"mode": "lantern", "delta": 2}), 400, "delta"),
    (body(classes=[10]), 400, "class labels must be in [0, 9]"),
    (body(classes=[-1]), 400, "class labels must be in"),
    (body(classes="3"), 400, "class labels"),
    (body(prompt="a fox"), 400, "class-conditional"),
    (body(classes=[1], settings={"lam": 0.5}), 400, "lam"),
    (body(classes=[1], settings={"k": 10_000}), 400, "neighbor table"),
    (body(classes=[1], settings={"temperature": "hot"}), 400, "must be a number"),
    (body(classes=[1], settings={"greedy": 1}), 400, "must be bool"),
    (body(classes=[1], seed=-3), 400, "seed"),
    (body(classes=[1, 2, 3], n=2), 400, "limit is 4"),
    (body(classes=[1, 2], response="png"), 400, "one image"),
    (body(classes=[1], response="tiff"), 400, "response"),
    (b"{" + b" " * 5_000_000 + b"}", 413, "limit"),
])
def test_bad_requests_get_a_4xx_with_one_line(service, raw, status, words):
    with pytest.raises(RequestError) as e:
        service.parse(raw)
    assert e.value.status == status and words in str(e.value) and "\n" not in str(e.value)
    code, kind, answer = service.respond(e.value)
    assert code == status and json.loads(answer)["error"] == str(e.value)


def test_a_cancelled_request_is_skipped_and_its_batch_mates_still_served(service):
    greedy = {"mode": "exact", "greedy": True}
    gone, kept = service.parse(body(classes=[2], settings=greedy)), service.parse(body(classes=[3], settings=greedy))
    gone.cancelled.set()
    results = service.run([gone, kept])
    assert isinstance(results[0], Cancelled)
    np.testing.assert_array_equal(results[1].tokens, direct(service, kept))
    kept.cancelled.set()
    assert all(isinstance(r, Cancelled) for r in service.run([kept]))


class GoneAfter(threading.Event):
    """A client that is there for the first `checks` looks and gone after."""

    def __init__(self, checks):
        super().__init__()
        self.checks = checks

    def is_set(self):
        self.checks -= 1
        return self.checks < 0


def test_a_client_gone_mid_generation_stops_its_call_and_the_engine_serves_on(service):
    settings = {"mode": "exact", "greedy": True}
    request = service.parse(body(classes=[2], settings=settings))
    gone = dataclasses.replace(request, cancelled=GoneAfter(3))  # there at batch start and two steps
    [result] = service.run([gone])
    assert isinstance(result, Cancelled) and "went away" in str(result)
    assert gone.cancelled.checks == -1  # stopped at the first step after it left, not at the end
    request = service.parse(body(classes=[2], settings=settings))
    np.testing.assert_array_equal(service.run([request])[0].tokens, direct(service, request))


def test_png_and_json_responses(service):
    request = service.parse(body(classes=[4], settings={"mode": "exact", "greedy": True}, response="png"))
    status, kind, png = service.respond(service.run([request])[0])
    assert status == 200 and kind == "image/png" and png[:8] == b"\x89PNG\r\n\x1a\n"
    request = service.parse(body(classes=[4], settings={"mode": "exact", "greedy": True}), request_id="abc")
    status, kind, answer = service.respond(service.run([request])[0])
    answer = json.loads(answer)
    assert status == 200 and answer["request_id"] == "abc" and len(answer["images"]) == 1
    assert len(answer["images"][0]["tokens"]) == 36 and answer["images"][0]["png_base64"]
    assert answer["stats"]["batch_images"] == 1 and answer["stats"]["mode"] == "exact"


def test_describe_says_what_the_engine_serves(service):
    d = service.describe()
    assert d["condition"] == "class" and d["num_classes"] == 10 and d["batch_sizes"] == [1, 2, 4]
    assert set(d["modes"]) == {"ar", "exact", "lantern", "lantern++"} and d["tree"] == "mc_sim_7b_63"


def test_caption_requests_batch_and_equal_direct_generation(t2i_engine):
    from engines import captions

    service = ImageService(Engine(t2i_engine, threads=1), max_batch=4)
    features, masks = captions(3)
    settings = {"mode": "lantern++", "lam": 2, "k": 8, "cfg_scale": 2.0}
    requests = [service.parse(body(caption=features[:1].tolist(), seed=4, settings=settings)),  # no mask: all real
                service.parse(body(caption=features[1:].tolist(), caption_mask=masks[1:].tolist(), seed=9,
                                   settings=settings))]
    results = service.run(requests)
    assert [r.stats["batch_images"] for r in results] == [4, 4]  # 3 images in one call, padded to 4
    for request, result in zip(requests, results):
        np.testing.assert_array_equal(result.tokens, direct(service, request))
    with pytest.raises(RequestError, match="t2i"):
        service.parse(body(classes=[1]))


def test_an_api_key_file_must_exist_and_hold_a_long_key(tmp_path):
    from lantern.runtime.errors import LanternError
    from lantern.tools.image_service import read_api_key

    (tmp_path / "key").write_text("  0123456789abcdef-key\n")
    assert read_api_key(tmp_path / "key") == "0123456789abcdef-key"
    (tmp_path / "short").write_text("abc\n")
    for name, words in (("short", "at least 16"), ("missing", "cannot read")):
        with pytest.raises(LanternError, match=words):
            read_api_key(tmp_path / name)
