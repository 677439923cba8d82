"""The server under a real uvicorn on 127.0.0.1: the official `openai` client, with and without
streaming, gets the library's images; a client that goes away cancels its images and frees their
rows."""
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from decoding_models import TinyFamily, single_thread  # noqa: E402, F401  (autouse fixture)
from serve_helpers import EXACT, LIMIT_S, library_images, served_pixels, uvicorn_server, wait_until  # noqa: E402
from specdec.decoding.streaming import StreamingEngine  # noqa: E402
from specdec.serve import create_app  # noqa: E402
from specdec.serve.engine_loop import EngineLoop  # noqa: E402


@pytest.fixture(scope="module")
def fam():
    return TinyFamily()


def test_the_openai_client_gets_the_library_images(fam):
    openai = pytest.importorskip("openai")
    app = create_app(fam, method="mulo", concurrency=2, model_name="tiny", partial_every=1, **EXACT)
    with uvicorn_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=LIMIT_S, max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        out = client.images.generate(model="tiny", prompt="c", n=2, extra_body={"seed": 5, "method": "ssd"})
        _, pixels = library_images(fam, "ssd", 2, 2, 5)
        assert [torch.equal(served_pixels(d.b64_json), pixels[j]) for j, d in enumerate(out.data)] == [True, True]
        assert out.usage.output_tokens == 32 and out.model_extra["specdec"]["method"] == "ssd"

        events = list(client.images.generate(model="tiny", prompt="b", stream=True, partial_images=2,
                                             extra_body={"seed": 8}))
        _, pixels = library_images(fam, "mulo", 1, 1, 8)
        kinds = [e.type for e in events]
        assert kinds[-1] == "image_generation.completed" and "image_generation.partial_image" in kinds
        assert torch.equal(served_pixels(events[-1].b64_json), pixels[0])

        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(model="tiny", prompt="b", extra_body={"tau": "small"})
        assert refused.value.body["param"] == "tau"


def test_a_client_that_goes_away_cancels_its_images(fam, monkeypatch):
    """A stream closed after its first partial image, and a whole response given up waiting:
    their images leave the engine (rows freed, nothing left queued), the server goes on."""
    step = StreamingEngine.step

    def slow(engine):     # (the tiny model decodes in milliseconds: time for the client to leave,
        time.sleep(0.03)  # and for uvicorn to notice, which it does when the handler next asks)
        return step(engine)

    monkeypatch.setattr(StreamingEngine, "step", slow)
    app = create_app(fam, method="ar", concurrency=1, partial_every=1, max_n=3)
    loop = app.state.service.loop
    body = {"prompt": "a", "n": 3, "seed": 1, "stream": True, "partial_images": 3}
    with uvicorn_server(app) as url:
        with httpx.Client(base_url=url, timeout=LIMIT_S) as client:
            with client.stream("POST", "/v1/images/generations", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("event: image_generation.partial_image"):
                        break
        wait_until(lambda: loop.outstanding == 0 and loop.running == 0, "the stream's images to be withdrawn")
        after_stream = _finished(url)
        with httpx.Client(base_url=url, timeout=0.1) as client, pytest.raises(httpx.ReadTimeout):
            client.post("/v1/images/generations", json={**body, "stream": False})
        wait_until(lambda: loop.outstanding == 0 and loop.running == 0, "the response's images to be withdrawn")
        after_response = _finished(url)
        with httpx.Client(base_url=url, timeout=LIMIT_S) as client:
            assert client.post("/v1/images/generations", json={"prompt": "a"}).status_code == 200
            metrics = client.get("/metrics").text
    assert after_stream < 3 and after_response - after_stream < 3      # (3 asked each time)
    assert 'specdec_requests_total{outcome="cancelled"} 2.0' in metrics


def _finished(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=LIMIT_S).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("specdec_images_finished_total"))


def test_a_request_the_drain_leaves_gets_its_503_and_uvicorn_stops(fam, monkeypatch):
    """uvicorn waits for the requests in flight before the app's lifespan shutdown, where the drain
    began: a request that never finished held the server up without a bound. The drain now begins
    with uvicorn's shutdown (`draining_server`): at the drain timeout the request gets its 503."""
    monkeypatch.setattr(EngineLoop, "_step", lambda loop, key, slot: None)   # (nothing ever finishes)
    app = create_app(fam, method="ar", concurrency=1, drain_timeout_s=0.2)
    answers = []
    with uvicorn_server(app) as url:
        client = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{url}/v1/images/generations", json={"prompt": "1"}, timeout=LIMIT_S)))
        client.start()
        wait_until(lambda: app.state.service.loop.outstanding > 0, "the request to be accepted")
    client.join(LIMIT_S)
    assert [r.status_code for r in answers] == [503]
    assert answers[0].json()["error"]["code"] == "unavailable"


def test_a_client_gone_before_its_body_is_sent_counts_cancelled(fam):
    """Half a body, then the connection closed: Starlette's ClientDisconnect used to escape the
    handler (a 500 to nobody and a traceback in uvicorn's log for every such client) and the
    request was never counted."""
    import socket

    app = create_app(fam, method="ar", concurrency=1)
    with uvicorn_server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=LIMIT_S) as s:
            s.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        wait_until(lambda: 'outcome="cancelled"} 1.0' in httpx.get(f"{url}/metrics", timeout=LIMIT_S).text,
                   "the request to be counted cancelled")
        metrics = httpx.get(f"{url}/metrics", timeout=LIMIT_S).text
    assert 'outcome="failed"} 1.0' not in metrics and 'outcome="invalid"} 1.0' not in metrics
