"""The server's HTTP surface: every bad request is a 4xx in OpenAI's error shape naming its
field, the model list, health and metrics; nothing here decodes more than one image."""
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402

from decoding_models import TinyFamily, single_thread  # noqa: E402, F401  (autouse fixture)
from specdec.serve import create_app  # noqa: E402
from specdec.serve.errors import APIError  # noqa: E402
from specdec.serve.protocol import parse_body  # noqa: E402

GOOD = {"prompt": "b", "seed": 1}


@pytest.fixture(scope="module")
def client():
    app = create_app(TinyFamily(), method="ar", concurrency=2, model_name="tiny", max_body_bytes=4096, max_n=4,
                     max_queue=4)
    with TestClient(app) as c:
        yield c


def _with(**fields):
    body = dict(GOOD)
    for k, v in fields.items():
        if v is _DROP:
            body.pop(k)
        else:
            body[k] = v
    return json.dumps(body).encode()


_DROP = object()

BAD = [
    # (name, body, status, param, code)
    ("malformed JSON", b'{"prompt": "b",', 400, None, "invalid_json"),
    ("not an object", b'["b"]', 400, None, "invalid_json"),
    ("not UTF-8", b'\xff\xfe{', 400, None, "invalid_json"),
    ("oversized", b'{"prompt": "' + b"x" * 5000 + b'"}', 413, None, "body_too_large"),
    ("no prompt", _with(prompt=_DROP), 400, "prompt", "missing_required_parameter"),
    ("prompt not a string", _with(prompt=7), 400, "prompt", "invalid_type"),
    ("unknown model", _with(model="dall-e-3"), 404, "model", "model_not_found"),
    ("unknown method", _with(method="beam"), 400, "method", "invalid_value"),
    ("n zero", _with(n=0), 400, "n", "invalid_value"),
    ("n above max_n", _with(n=5), 400, "n", "invalid_value"),
    ("n a string", _with(n="2"), 400, "n", "invalid_type"),
    ("n a bool", _with(n=True), 400, "n", "invalid_type"),
    ("a size the family cannot make", _with(size="1024x1024"), 400, "size", "unsupported_size"),
    ("unknown class", _with(prompt="a dragon"), 400, "prompt", "unknown_class"),
    ("class id out of range", _with(prompt="3"), 400, "prompt", "unknown_class"),
    ("class_id out of range", _with(class_id=9), 400, "class_id", "invalid_value"),
    ("url response", _with(response_format="url"), 400, "response_format", "invalid_value"),
    ("unknown output format", _with(output_format="gif"), 400, "output_format", "invalid_value"),
    ("compression out of range", _with(output_compression=101), 400, "output_compression", "invalid_value"),
    ("too many partial images", _with(stream=True, partial_images=4), 400, "partial_images", "invalid_value"),
    ("transparent background", _with(background="transparent"), 400, "background", "invalid_value"),
    ("negative seed", _with(seed=-1), 400, "seed", "invalid_value"),
    ("seed too large", _with(seed=2 ** 64), 400, "seed", "invalid_value"),
    ("seed past 32 bits", _with(seed=2 ** 32), 400, "seed", "invalid_value"),
    ("first_index past 32 bits", _with(first_index=2 ** 32), 400, "first_index", "invalid_value"),
    ("first_index + n past 32 bits", _with(first_index=2 ** 32 - 1, n=2), 400, "first_index", "invalid_value"),
    ("nested too deeply", b"[" * 1500 + b"]" * 1500, 400, None, "invalid_json"),
    ("a digit that is not ASCII", _with(prompt="\u00b2"), 400, "prompt", "unknown_class"),
    ("an Arabic-Indic digit", _with(prompt="\u0663"), 400, "prompt", "unknown_class"),
    ("cfg_scale overflowing float32", _with(cfg_scale=1e308), 400, "cfg_scale", "invalid_value"),
    ("temperature underflowing", _with(temperature=1e-40), 400, "temperature", "invalid_value"),
    ("top_k past int64", _with(top_k=2 ** 63), 400, "top_k", "invalid_value"),
    ("radius past int64", _with(method="mulo", radius=2 ** 63), 400, "radius", "invalid_value"),
    # options that do not fit the models: refused by the engine, named, and before a stream begins
    ("a window wider than the grid", _with(method="zipar", window=5), 400, "window", "invalid_value"),
    ("... streamed", _with(method="zipar", window=5, stream=True), 400, "window", "invalid_value"),
    ("more vertical heads than the heads", _with(method="ssd", vertical_heads=3), 400, "vertical_heads",
     "invalid_value"),
    ("a preview the family lacks", _with(method="mulo", draft="preview"), 400, "draft", "invalid_value"),
    ("negative first_index", _with(first_index=-2), 400, "first_index", "invalid_value"),
    ("cfg_scale a string", _with(cfg_scale="high"), 400, "cfg_scale", "invalid_type"),
    ("temperature zero", _with(temperature=0.0), 400, "temperature", "invalid_value"),
    ("top_p above one", _with(top_p=1.5), 400, "top_p", "invalid_value"),
    ("an option the method does not take", _with(tau=0.1), 400, "tau", "unknown_parameter"),
    ("an option of another method", _with(method="sd", tau=0.1), 400, "tau", "unknown_parameter"),
    ("a bad option value", _with(method="mulo", tau=-1.0), 400, "tau", "invalid_value"),
    ("a bad option type", _with(method="ssd", rounds="two"), 400, "rounds", "invalid_value"),
    ("an unknown preset", _with(method="ssd", preset="fastest"), 400, "preset", "invalid_value"),
    ("a model passed as an option", _with(method="sd", drafter="x"), 400, "drafter", "unknown_parameter"),
    ("exact with a lossy method", _with(method="mulo", exact=True), 400, "exact", "invalid_value"),
    ("exact not a bool", _with(exact="yes"), 400, "exact", "invalid_type"),
]


@pytest.mark.parametrize("body,status,param,code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_request_is_an_openai_error_naming_its_field(client, body, status, param, code):
    r = client.post("/v1/images/generations", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)


def test_unknown_routes_and_methods_answer_in_the_error_shape(client):
    r = client.get("/v1/images/edits")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/v1/images/generations")
    assert r.status_code == 405 and "error" in r.json()
    r = client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_models_health_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    card = models["data"][0]
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "specdec"
    assert card["specdec"]["classes"] == ["a", "b", "c"] and card["specdec"]["size"] == "8x8"
    assert card["specdec"]["exact_methods"] == ["ar", "sd", "sjd"] and card["specdec"]["exact_by_default"] is False
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert client.head("/health").status_code == 200      # (probes that send HEAD)
    assert health.headers["x-specdec-server"]
    r = client.post("/v1/images/generations", json={"prompt": "B", "seed": 0})   # (a class name in any case)
    assert r.status_code == 200
    text = client.get("/metrics").text
    for name in ("specdec_queue_depth", "specdec_rows_running", "specdec_images_finished_total",
                 "specdec_images_per_second", "specdec_target_passes_per_image_bucket", "specdec_acceptance",
                 "specdec_image_latency_seconds_bucket", "specdec_time_to_first_partial_seconds",
                 'specdec_requests_total{outcome="invalid"}'):
        assert name in text, name
    assert 'specdec_images_finished_total{method="ar"} 1.0' in text


def test_the_page_is_served(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/v1/images/generations" in r.text and "image_generation.partial_image" in r.text


def test_a_prompt_conditioned_family_serves_the_library_image_of_its_prompt():
    """A text-conditioned family (a tiny transformers Janus, its prompts tokenized one id per
    letter) takes the request's prompt as its prompt: the image `decode(prompts=[...])` gives for
    that seed, bit for bit; a class_id or a prompt the model cannot take is a 400 naming it."""
    pytest.importorskip("transformers")
    import torch
    from janus_models import BOI, BOS, tiny_janus
    from serve_helpers import EXACT, served_pixels

    from specdec import decoding
    from specdec.images import to_uint8
    from specdec.models import hf
    from specdec.numerics import batch_invariant

    fam = hf.wrap(tiny_janus(patches=4, seed=0, layers=1), max_prompt_len=12)
    fam.target.tokenize = lambda text: torch.tensor([BOS] + [4 + ord(c) % 26 for c in text] + [BOI])
    with TestClient(create_app(fam, method="ar", concurrency=2, **EXACT)) as c:
        r = c.post("/v1/images/generations", json={"prompt": "a red fox", "seed": 3})
        assert r.status_code == 200, r.text
        with batch_invariant():
            want = decoding.decode("ar", fam, prompts=["a red fox"], seed=3, backend="reference")
        assert torch.equal(served_pixels(r.json()["data"][0]["b64_json"]), to_uint8(want.images)[0])
        for body, param in (({"prompt": "fox", "class_id": 1}, "class_id"), ({"prompt": "a much longer prompt"},
                                                                              "prompt")):
            r = c.post("/v1/images/generations", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert c.get("/v1/models").json()["data"][0]["specdec"]["classes"] is None


def test_a_family_without_a_pixel_decoder_is_refused_at_start():
    fam = TinyFamily()
    fam.tokenizer = None
    with pytest.raises(ValueError, match="pixel decoder"):
        create_app(fam)


@pytest.mark.parametrize("settings,match", [
    (dict(method="zipar", options={"window": 5}), "window must be an int in"),
    (dict(method="mulo", options={"draft": "preview"}), "needs the target's preview stage"),
    (dict(backend="cuda"), "backend='cuda' is unavailable"),
])
def test_a_server_whose_own_settings_do_not_fit_its_models_does_not_start(settings, match):
    """They passed the options' own checks, started, and failed every request with a 500."""
    with pytest.raises(ValueError, match=match):
        create_app(TinyFamily(), **settings)


def test_a_body_python_cannot_read_is_invalid_json():
    """A number of more digits than Python reads (a ValueError of its own) and a body nested past
    the parser's stack were 500s."""
    for raw in (b'{"prompt": "b", "seed": ' + b"9" * 5000 + b"}", b"[" * 5000 + b"]" * 5000):
        with pytest.raises(APIError) as caught:
            parse_body(raw)
        assert (caught.value.status, caught.value.code) == (400, "invalid_json")


def test_a_request_whose_submission_fails_is_answered_and_the_server_goes_on(monkeypatch):
    """An exception other than a ValueError from `submit` lost the request: no answer, ever (a
    streamed one now waits for its engine before its headers, so it would have hung)."""
    app = create_app(TinyFamily(), method="ar", concurrency=2)
    loop = app.state.service.loop
    build = loop._build

    def failing_for_seed_13(key, compile=None):
        engine = build(key, compile)
        submit = engine.submit

        def submit_or_fail(*args, **kwargs):
            if kwargs.get("seed") == 13:
                raise RuntimeError("boom")
            return submit(*args, **kwargs)
        engine.submit = submit_or_fail
        return engine
    monkeypatch.setattr(loop, "_build", failing_for_seed_13)
    with TestClient(app) as c:
        for stream in (True, False):
            r = c.post("/v1/images/generations", json={"prompt": "b", "seed": 13, "stream": stream})
            assert r.status_code == 500 and "submitting the request failed" in r.json()["error"]["message"]
        assert c.post("/v1/images/generations", json={"prompt": "b", "seed": 1}).status_code == 200


def test_a_stream_that_waits_long_for_its_engine_begins_with_keep_alives(monkeypatch):
    """A streamed response waits for its images to reach their engine, but not past the keep-alive
    interval: proxies drop a connection that sends nothing."""
    app = create_app(TinyFamily(), method="ar", concurrency=2, keepalive_s=0.3)
    loop = app.state.service.loop
    slot_for, since = loop._slot_for, time.monotonic()
    monkeypatch.setattr(loop, "_slot_for", lambda key: None if time.monotonic() - since < 2.0 else slot_for(key))
    with TestClient(app) as c:
        with c.stream("POST", "/v1/images/generations", json={"prompt": "b", "seed": 1, "stream": True}) as r:
            assert r.status_code == 200
            text = "".join(r.iter_text())
    assert ": keep-alive" in text and "image_generation.completed" in text
