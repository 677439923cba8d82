"""The server's images and its engine loop, in process: each request gets bit for bit the images
`decode` gives its seed and indices, streams send partial images then the image, requests share
the running batch, the queue is bounded, shutdown drains, and no request (malformed, failing,
gone) stops the loop or the others."""
import asyncio
import json
import random
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from decoding_models import TinyFamily, single_thread  # noqa: E402, F401  (autouse fixture)
from serve_helpers import EXACT, library_images, run, served_pixels, serving, sse_events  # noqa: E402
from specdec.decoding.streaming import StreamingEngine  # noqa: E402
from specdec.serve import create_app  # noqa: E402
from specdec.serve.engine_loop import EngineLoop  # noqa: E402

#: (method, class, n, seed, first_index, options) of requests sent at once
REQUESTS = [("ar", 1, 2, 5, 0, {}), ("mulo", 2, 2, 7, 3, {}), ("ssd", 0, 1, 11, 0, {}),
            ("mulo", 0, 1, 7, 0, {"tau": 0.1}), ("ar", 2, 3, 9, 1, {}), ("sd", 1, 1, 2, 0, {})]


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


def _body(method, class_id, n, seed, first, options, **more):
    return {"prompt": str(class_id), "method": method, "n": n, "seed": seed, "first_index": first,
            "return_tokens": True, **options, **more}


def test_each_request_gets_the_library_images_of_its_seed(fam, monkeypatch):
    """Requests of several methods and options at once, rows fewer than images (queued, refilled):
    image j of a request is image first_index + j of `decode` with its seed, tokens and pixels bit for bit;
    requests with the same settings share one engine, whose rows all run at once; the engines
    alive stay within max_engines."""
    busy = []
    step = StreamingEngine.step
    monkeypatch.setattr(StreamingEngine, "step", lambda engine: (busy.append(engine.running), step(engine))[1])
    app = create_app(fam, method="ar", concurrency=2, **EXACT)

    async def main():
        async with serving(app) as client:
            answers = await asyncio.gather(*[client.post("/v1/images/generations", json=_body(*r)) for r in REQUESTS])
            return answers, app.state.service.loop.engines

    answers, engines = run(main())
    assert engines == 4            # (5 settings, at most max_engines at once: an idle engine made room)
    assert max(busy) == 2          # (a step made both rows' images at once)
    for (method, class_id, n, seed, first, options), r in zip(REQUESTS, answers):
        assert r.status_code == 200, r.text
        body = r.json()
        tokens, pixels = library_images(fam, method, class_id, n, seed, first, **options)
        assert len(body["data"]) == n and body["specdec"]["seed"] == seed
        for j, item in enumerate(body["data"]):
            assert torch.equal(torch.tensor(item["tokens"]), tokens[j]), (method, j)
            assert torch.equal(served_pixels(item["b64_json"]), pixels[j]), (method, j)
            stats = body["specdec"]["images"][j]
            assert stats["index"] == j and stats["stream_index"] == first + j and stats["target_passes"] > 0
        assert body["usage"]["output_tokens"] == n * 16


@pytest.mark.parametrize("method", ["ar", "mulo"])
def test_a_stream_sends_partial_images_then_each_image(fam, method):
    """`stream: true`: partial images (at most partial_images per image, indices 0, 1, ... in
    order, each showing a final part of the image), then `image_generation.completed` with the
    image the whole response gives."""
    app = create_app(fam, method=method, concurrency=2, partial_every=1, **EXACT)
    body = _body(method, 1, 2, 4, 0, {}, stream=True, partial_images=3)

    async def main():
        async with serving(app) as client:
            return await client.post("/v1/images/generations", json=body)

    r = run(main())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    tokens, pixels = library_images(fam, method, 1, 2, 4)
    for j in range(2):
        mine = [(e, d) for e, d in events if d["index"] == j]
        kinds = [e for e, _ in mine]
        assert kinds[-1] == "image_generation.completed" and kinds.count("image_generation.completed") == 1
        partials = [d for e, d in mine if e == "image_generation.partial_image"]
        assert 1 <= len(partials) <= 3
        assert [d["partial_image_index"] for d in partials] == list(range(len(partials)))
        done = mine[-1][1]
        assert torch.equal(served_pixels(done["b64_json"]), pixels[j])
        assert torch.equal(torch.tensor(done["tokens"]), tokens[j])
        assert done["usage"]["output_tokens"] == 16 and done["size"] == "8x8"
        if method == "ar":   # a partial image is the image's final raster prefix, grey after it
            top = served_pixels(partials[0]["b64_json"])
            shown = (top != 128).flatten(0, 1).any(-1).view(8, 8)
            assert shown.any() and torch.equal(top[shown], pixels[j][shown])


def test_the_queue_is_bounded_with_429_and_retry_after(fam, monkeypatch):
    """Images accepted beyond concurrency + max_queue are refused at once with 429 and
    Retry-After; once they finish, requests are accepted again."""
    iteration = EngineLoop._iteration
    held = {"on": True}

    def paused(loop):
        while held["on"]:
            loop._read_inbox(block=True)     # (takes requests, steps nothing)
        iteration(loop)

    monkeypatch.setattr(EngineLoop, "_iteration", paused)
    app = create_app(fam, method="ar", concurrency=1, max_queue=2, max_n=3, **EXACT)

    async def main():
        async with serving(app) as client:
            first = asyncio.ensure_future(client.post("/v1/images/generations", json=_body("ar", 0, 3, 1, 0, {})))
            while app.state.service.loop.outstanding < 3:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/images/generations", json=_body("ar", 0, 1, 1, 0, {}))
            metrics = (await client.get("/metrics")).text
            held["on"] = False
            accepted = await first
            again = await client.post("/v1/images/generations", json=_body("ar", 0, 1, 1, 0, {}))
            return refused, metrics, accepted, again

    refused, metrics, accepted, again = run(main())
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    assert "specdec_queue_depth 3.0" in metrics and 'specdec_requests_total{outcome="rejected"} 1.0' in metrics
    assert accepted.status_code == 200 and again.status_code == 200


def test_shutdown_drains_every_accepted_request(fam):
    """Leaving the lifespan while requests run: every one of them gets its images (drain)."""
    app = create_app(fam, method="mulo", concurrency=2, **EXACT)
    answers = []

    async def main():
        async with serving(app) as client:
            tasks = [asyncio.ensure_future(client.post("/v1/images/generations", json=_body("mulo", c, 2, c, 0, {})))
                     for c in range(3)]
            while app.state.service.loop.outstanding < 6:
                await asyncio.sleep(0.005)
        answers.extend(await asyncio.gather(*tasks))     # (the lifespan has drained by now)

    run(main())
    assert [r.status_code for r in answers] == [200] * 3
    assert not app.state.service.loop.alive


def test_a_drain_that_times_out_answers_every_request_with_an_error(fam, monkeypatch):
    """Requests still unfinished when the drain's time is up get a 503 error each, none is dropped."""
    monkeypatch.setattr(EngineLoop, "_step", lambda loop, key, slot: None)   # (nothing ever finishes)
    app = create_app(fam, method="ar", concurrency=1, drain_timeout_s=0.2)
    answers = []

    async def main():
        async with serving(app) as client:
            tasks = [asyncio.ensure_future(client.post("/v1/images/generations", json=_body("ar", 0, 2, s, 0, {})))
                     for s in range(3)]
            while app.state.service.loop.outstanding < 6:
                await asyncio.sleep(0.005)
        answers.extend(await asyncio.gather(*tasks))

    run(main())
    assert [r.status_code for r in answers] == [503] * 3
    assert all(r.json()["error"]["code"] == "unavailable" for r in answers)


def test_ending_a_drain_answers_what_is_left_at_once(fam, monkeypatch):
    """A forced exit (a second Ctrl-C) ends a drain under way (`EngineLoop.end_drain`): the requests
    left get their 503 now, not after the drain's 60 s."""
    import threading

    monkeypatch.setattr(EngineLoop, "_step", lambda loop, key, slot: None)   # (nothing ever finishes)
    app = create_app(fam, method="ar", concurrency=1, drain_timeout_s=60)
    answers = []

    async def main():
        async with app.router.lifespan_context(app):
            import httpx

            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://specdec.test", timeout=30) as client:
                task = asyncio.ensure_future(client.post("/v1/images/generations", json=_body("ar", 0, 1, 1, 0, {})))
                loop = app.state.service.loop
                while loop.outstanding < 1:
                    await asyncio.sleep(0.005)
                closing = threading.Thread(target=loop.close)
                closing.start()
                while loop.accepting:
                    await asyncio.sleep(0.005)
                loop.end_drain()
                answers.append(await task)
                closing.join(30)
                assert not closing.is_alive()

    run(main())
    assert [r.status_code for r in answers] == [503]


def test_a_failing_engine_fails_its_requests_and_the_loop_goes_on(fam, monkeypatch):
    """An engine whose step raises ends the requests it held with a 500; requests of other
    engines, and later requests of the same settings (a new engine), get their images."""
    step = StreamingEngine.step

    def faulty(engine):
        if engine.method == "ssd" and not getattr(faulty, "done", False):
            faulty.done = True
            raise RuntimeError("a device error")
        return step(engine)

    monkeypatch.setattr(StreamingEngine, "step", faulty)
    app = create_app(fam, method="ar", concurrency=2, **EXACT)

    async def main():
        async with serving(app) as client:
            post = client.post
            first = await asyncio.gather(post("/v1/images/generations", json=_body("ssd", 0, 1, 3, 0, {})),
                                         post("/v1/images/generations", json=_body("ar", 1, 2, 3, 0, {})))
            later = await post("/v1/images/generations", json=_body("ssd", 0, 1, 3, 0, {}))
            return first, later

    (broken, fine), later = run(main())
    assert broken.status_code == 500 and "a device error" in broken.json()["error"]["message"]
    assert fine.status_code == 200 and later.status_code == 200
    _, pixels = library_images(fam, "ssd", 0, 1, 3)
    assert torch.equal(served_pixels(later.json()["data"][0]["b64_json"]), pixels[0])


def _malformed(rng: random.Random) -> bytes:
    """A body that must be refused: broken JSON, wrong types, values out of range, unknown fields."""
    kind = rng.randrange(6)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 1:
        return json.dumps({"prompt": "a", "n": 1})[:rng.randrange(1, 20)].encode()
    if kind == 2:
        return json.dumps(rng.choice([None, 3, "x", [1, 2], True, {"prompt": None}])).encode()
    if kind == 3:   # an option of the method out of its range
        method, field, value = rng.choice([("mulo", "tau", -1.0), ("mulo", "radius", -2), ("ssd", "rounds", -1),
                                           ("ssd", "commit", "maybe"), ("sjd", "window", "wide")])
        return json.dumps({"prompt": "a", "method": method, field: value}).encode()
    field, value = rng.choice([("n", rng.choice([0, -3, 99, "2", 1.5, [1]])), ("seed", rng.choice([-1, "s", 1.5])),
                               ("method", rng.choice(["", "AR", "beam", 3])), ("size", rng.choice(["9x9", "", 8])),
                               ("temperature", rng.choice([0, -1, "hot"])), ("top_k", rng.choice([-1, 0.5])),
                               ("partial_images", rng.choice([-1, 9])), ("chunk", 4), ("window", 0),
                               ("class_id", rng.choice([-1, 3, "a"])), ("output_format", "bmp"),
                               ("prompt", rng.choice(["zebra", "", "-1", 12, "x" * 5000]))])
    return json.dumps({"prompt": "a", field: value}).encode()


def test_malformed_requests_never_stop_the_loop_or_the_valid_ones(fam):
    """200 malformed bodies interleaved with valid requests: each malformed one is a 4xx in the
    error shape, each valid one gets the library's images."""
    rng = random.Random(0)
    bad = [_malformed(rng) for _ in range(200)]
    app = create_app(fam, method="ar", concurrency=2, max_body_bytes=4096, **EXACT)
    valid = [("ar", c % 3, 1, 100 + c, 0, {}) for c in range(6)]

    async def main():
        async with serving(app) as client:
            post = client.post
            good, refused = [], []
            for i in range(0, len(bad), 20):    # (a valid request among each 20 malformed ones)
                if i // 20 < len(valid):
                    good.append(asyncio.ensure_future(post("/v1/images/generations", json=_body(*valid[i // 20]))))
                refused += await asyncio.gather(*[post("/v1/images/generations", content=b) for b in bad[i:i + 20]])
            return await asyncio.gather(*good), refused, app.state.service.loop.alive

    good, refused, alive = run(main())
    assert alive
    for r in refused:
        assert 400 <= r.status_code < 500, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    for (method, class_id, n, seed, first, _), r in zip(valid, good):
        assert r.status_code == 200
        _, pixels = library_images(fam, method, class_id, n, seed, first)
        assert torch.equal(served_pixels(r.json()["data"][0]["b64_json"]), pixels[0])


def test_exact_requests_get_ars_image_of_their_seed_whatever_the_method_and_load(fam):
    """`exact: true` (or `specdec serve --exact`): sd and sjd requests sent at once with ar's,
    at any draft length, get exact `ar`'s image of their seed bit for bit, the widths chosen by
    the load; a lossy method is refused naming the field the client chose, and `exact: false`
    opts a request out of a server's exact default."""
    requests = [("ar", {}), ("sd", {"chunk": 2}), ("sd", {"chunk": 4}), ("sjd", {})]
    app = create_app(fam, method="sd", concurrency=3, exact=True, **EXACT)

    async def main():
        async with serving(app) as client:
            answers = await asyncio.gather(*[client.post("/v1/images/generations", json=_body(
                method, 2, 2, 13, 1, options)) for method, options in requests])
            refused = await client.post("/v1/images/generations", json=_body("mulo", 2, 1, 13, 0, {}))
            lossy = await client.post("/v1/images/generations", json=_body("mulo", 2, 1, 13, 0, {}, exact=False))
            return answers, refused, lossy

    answers, refused, lossy = run(main())
    tokens, pixels = library_images(fam, "ar", 2, 2, 13, 1, exact=True)
    for (method, _), r in zip(requests, answers):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["specdec"]["exact"] is True
        for j, item in enumerate(body["data"]):
            assert torch.equal(torch.tensor(item["tokens"]), tokens[j]), method
            assert torch.equal(served_pixels(item["b64_json"]), pixels[j]), method
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "method"
    assert "exact: false" in refused.json()["error"]["message"]
    assert lossy.status_code == 200 and lossy.json()["specdec"]["exact"] is False
    want, _ = library_images(fam, "mulo", 2, 1, 13)
    assert torch.equal(torch.tensor(lossy.json()["data"][0]["tokens"]), want[0])


def test_a_server_warms_up_its_default_engine_first_and_says_so(fam, monkeypatch):
    """`ServeConfig.warm_up` (`specdec serve --compile`): before any request the default engine
    decodes throwaway images (`StreamingEngine.warm_up`); meanwhile /health says warming_up (503)
    and requests wait. Then they get their seed's library images, and a request without a seed
    gets the seed a server without the warm-up would pick."""
    import threading

    gate, warmed = threading.Event(), []
    warm_up = StreamingEngine.warm_up

    def gated(engine, *args, **kwargs):
        gate.wait(60)
        warmed.append(warm_up(engine, *args, **kwargs))
        return warmed[-1]
    monkeypatch.setattr(StreamingEngine, "warm_up", gated)

    async def main(app, warming: bool):
        async with serving(app) as client:
            health = None
            if warming:
                answer = await client.get("/health")
                health = answer.json()["status"], answer.status_code
            first = asyncio.ensure_future(client.post("/v1/images/generations", json=_body("ar", 1, 2, 5, 0, {})))
            await asyncio.sleep(0.2)
            waited = not first.done()
            gate.set()
            unseeded = (await client.post("/v1/images/generations", json={"prompt": "2"})).json()["specdec"]["seed"]
            return health, waited, await first, (await client.get("/health")).status_code, unseeded

    health, waited, r, ready, seed = run(main(create_app(fam, method="ar", concurrency=2, warm_up=True, **EXACT), True))
    assert health == ("warming_up", 503) and waited and ready == 200
    assert warmed == [1 + 2 + 2]        # groups of 1 and 2, of 1 beside a busy row
    tokens, _ = library_images(fam, "ar", 1, 2, 5)
    assert r.status_code == 200 and all(torch.equal(torch.tensor(item["tokens"]), tokens[j])
                                        for j, item in enumerate(r.json()["data"]))
    _, _, _, _, plain_seed = run(main(create_app(fam, method="ar", concurrency=2, **EXACT), False))
    assert seed == plain_seed and warmed == [5]


def test_a_stream_whose_client_goes_while_its_last_image_is_encoded_counts_cancelled(fam, monkeypatch):
    """The last `completed` event was counted before its PNG was encoded: a client gone meanwhile
    never got it, yet the request counted `ok`. Now an image counts once its event is sent."""
    import specdec.serve.responses as responses

    gone, encoded = threading.Event(), []
    encode = responses.encode

    def encode_and_leave(*args):
        encoded.append(1)
        if len(encoded) == 2:       # the second (last) image: the client leaves while it is encoded
            gone.set()
            time.sleep(0.3)
        return encode(*args)

    monkeypatch.setattr(responses, "encode", encode_and_leave)
    app = create_app(fam, method="ar", concurrency=2)
    body = json.dumps({"prompt": "a", "n": 2, "seed": 1, "stream": True}).encode()
    sent, received = [], []

    async def receive():
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        while not gone.is_set():
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message):
        if not gone.is_set() and message["type"] == "http.response.body":
            received.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/images/generations", "query_string": b"",
             "raw_path": b"/v1/images/generations", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2), "headers": [(b"content-type", b"application/json")], "state": {}}

    async def go():
        async with app.router.lifespan_context(app):
            await app(scope, receive, send)
            for _ in range(200):      # (the stream's generator is closed after the response ends)
                metrics = app.state.service.metrics.render()[0].decode()
                if "specdec_requests_total{" in metrics:
                    return metrics
                await asyncio.sleep(0.01)
            return metrics

    metrics = run(go())
    assert b"".join(received).count(b"event: image_generation.completed") == 1
    assert 'outcome="cancelled"} 1.0' in metrics and 'outcome="ok"} 1.0' not in metrics
