"""`specdec serve`: an OpenAI-compatible image endpoint on the streaming engine
(`specdec.decoding.stream`), partial images as they form, one engine loop per process, and the
same app as a Ray Serve deployment (docs/serving.md).

    from specdec.serve import create_app
    app = create_app(family, method="mulo", concurrency=16)   # uvicorn, or any ASGI server

Modules, one job each: `config` (ServeConfig, ModelSpec), `protocol` (the wire format),
`conditions` (a request's prompt as what the engine takes), `requests` (a request checked and
resolved), `engine_loop` (the thread that owns the engines), `jobs` (a request on it),
`render` (pixels to PNG/JPEG/WebP, partial images), `responses` (events to HTTP), `metrics`,
`server` (the FastAPI app), `page` (the browser page at `/`), `command` (`specdec serve`), `ray_app`
(Ray Serve).

`specdec.serve.app` in Ray's sense (`serve run specdec.serve:app`) is the Ray Serve application
builder `specdec.serve.ray_app.app`, imported when asked for (Ray is an optional extra).
"""
from __future__ import annotations

from specdec.serve.config import ModelSpec, ServeConfig


def create_app(family, config=None, **kwargs):
    """The FastAPI app of `family` (specdec.serve.server.create_app)."""
    from specdec.serve.server import create_app as make

    return make(family, config, **kwargs)


def __getattr__(name: str):
    # `app`: the Ray Serve application builder (`serve run specdec.serve:app`), imported lazily
    # so that `import specdec.serve` needs no Ray.
    if name == "app":
        from specdec.serve.ray_app import app

        return app
    raise AttributeError(name)


__all__ = ["ModelSpec", "ServeConfig", "create_app"]
