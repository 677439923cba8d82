"""The FastAPI app: OpenAI's `POST /v1/images/generations` (whole responses or server-sent events
with partial images), `GET /v1/models`, `GET /health` and `GET /metrics`, over one engine loop
(specdec.serve.engine_loop) started and drained with the app's lifespan.

    app = create_app(family, method="mulo", concurrency=16)     # any ASGI server runs it
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from contextlib import asynccontextmanager
from functools import partial
from typing import Optional

import anyio
import torch
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from specdec.decoding import EXACT_METHODS, METHODS, options_for
from specdec.decoding.results import decode_images
from specdec.serve.conditions import class_names, prompt_conditioned
from specdec.serve.config import ServeConfig
from specdec.serve.engine_loop import EngineLoop
from specdec.serve.errors import APIError
from specdec.serve.metrics import ServeMetrics
from specdec.serve.page import PAGE
from specdec.serve.protocol import ImageGenerationBody, parse_body
from specdec.serve.render import output_formats
from specdec.serve.requests import Planner, tokens_per_image
from specdec.serve.responses import collect, error_response, event_stream, read_body, started


class Service:
    """What the routes share: the family, the configuration, the planner, the engine loop and the
    metrics."""

    def __init__(self, family, config: ServeConfig, models: Optional[dict] = None):
        tokenizer = getattr(family, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("this model has no pixel decoder (a LlamaGen checkpoint needs --vq; transformers' "
                             "GLM-Image and Chameleon bring none): the images API returns images")
        target = family.target
        if getattr(target, "num_classes", None) is None and not hasattr(target, "encode_prompts"):
            raise ValueError("this model takes T5 caption features (LlamaGen text-to-image), which the server cannot "
                             "make from a request's text")
        # (the server's own options are checked once here, not found wrong in every request)
        options_for(config.method, config.preset, family, **config.options)
        H, W = family.target.grid
        h, w = decode_images(torch.zeros(1, H, W, dtype=torch.long), tokenizer).shape[-2:]
        self.family, self.config, self.size = family, config, f"{w}x{h}"
        self.tokens_per_image = tokens_per_image(family)
        self.planner = Planner(family, config, self.size, output_formats())
        self.loop = EngineLoop(family, config, models=models, image_size=(h, w))
        self.metrics = ServeMetrics(lambda: self.loop.queue_depth, lambda: self.loop.running,
                                    lambda: self.loop.engines)
        self.loop.metrics = self.metrics
        # The default request (a seed given, not one of the planner's): its engine checked now,
        # and warmed up first when asked
        prompt = "a photo" if prompt_conditioned(family) else "0"
        default = self.planner.plan(ImageGenerationBody(prompt=prompt, seed=0))
        self.loop.check_default(default.key)
        if config.warm_up:
            self.loop.warm_up_first(default)
        self.started = int(time.time())

    def model_card(self) -> dict:
        c = self.config
        return {"id": c.model_name, "object": "model", "created": self.started, "owned_by": "specdec",
                "specdec": {"methods": list(METHODS), "default_method": c.method, "exact_methods": list(EXACT_METHODS),
                            "exact_by_default": c.run.exact, "size": self.size,
                            "classes": None if prompt_conditioned(self.family) else class_names(self.family),
                            "concurrency": c.concurrency, "max_n": c.max_n}}


async def generate(request: Request):
    service: Service = request.app.state.service
    try:
        body = parse_body(await read_body(request, service.config.max_body_bytes))
        plan = service.planner.plan(body)
        events: asyncio.Queue = asyncio.Queue()
        deliver = partial(asyncio.get_running_loop().call_soon_threadsafe, events.put_nowait)
        job = service.loop.submit(plan, deliver)
    except APIError as error:
        service.metrics.request_done(error.outcome)
        return error_response(error)
    if plan.stream:
        refused = await started(service, job, events, request)
        if refused is not None:
            return refused
        return StreamingResponse(event_stream(service, job, events, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await collect(service, job, events, request)


async def list_models(request: Request):
    return {"object": "list", "data": [request.app.state.service.model_card()]}


async def get_model(request: Request, model_id: str):
    service: Service = request.app.state.service
    if model_id != service.config.model_name:
        return error_response(APIError(404, f"the model {model_id!r} does not exist here", "model", "model_not_found"))
    return service.model_card()


async def get_health(request: Request):
    loop = request.app.state.service.loop
    status = "ok" if loop.accepting else ("draining" if loop.alive else "stopped")
    if status == "ok" and loop.warming_up:
        status = "warming_up"       # (requests are accepted, and wait until it is done)
    body = {"status": status, "queue_depth": loop.queue_depth, "running": loop.running, "engines": loop.engines}
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


async def get_metrics(request: Request):
    body, content_type = request.app.state.service.metrics.render()
    return Response(body, media_type=content_type)


async def get_page(request: Request):
    return HTMLResponse(PAGE)


async def _http_error(request: Request, exc: StarletteHTTPException):
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(APIError(exc.status_code, str(exc.detail), None, code))


async def _unexpected(request: Request, exc: Exception):
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", None, "server_error"))


def create_app(family, config: Optional[ServeConfig] = None, *, models: Optional[dict] = None,
               **settings) -> FastAPI:
    """The server of `family` (a `ModelFamily` or any object with its fields), with `config`'s
    settings and then `settings` (fields of ServeConfig: method="ssd", concurrency=16, ...);
    `models`: extra models for the methods that take them (drafter, heads, upsampler)."""
    config = (config or ServeConfig()).replace(**settings) if settings else (config or ServeConfig())
    service = Service(family, config, models)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.loop.start()
        try:
            yield
        finally:
            # Drain: every accepted request gets its images or an error before the loop stops.
            await anyio.to_thread.run_sync(service.loop.close)

    app = FastAPI(title="specdec", summary="OpenAI-compatible image generation with speculative decoding",
                  lifespan=lifespan)
    app.state.service = service
    app.add_api_route("/v1/images/generations", generate, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id}", get_model, methods=["GET"])
    app.add_api_route("/health", get_health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", get_metrics, methods=["GET"])
    app.add_api_route("/", get_page, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(ServerName)
    return app


class ServerName:
    """Names the process that answered (a Ray replica, a uvicorn worker) in an `x-specdec-server`
    header, for logs and load checks. Plain ASGI: it touches neither the body nor `receive`, so
    streams and the watch for gone clients go through as they are."""

    def __init__(self, app):
        self.app = app
        self.header = (b"x-specdec-server", f"{socket.gethostname()}:{os.getpid()}".encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


__all__ = ["Service", "create_app"]
