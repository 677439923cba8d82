"""From the engine loop's events to HTTP: the whole response of a request (`collect`), or its
server-sent events as they come (`event_stream`). Both watch the client: one that goes away
cancels its request's images, which frees their rows."""
from __future__ import annotations

import asyncio
import time
from typing import Optional

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from specdec.serve.errors import APIError
from specdec.serve.jobs import Failed, ImageReady, Job, PartialImage, Started
from specdec.serve.protocol import completed_event, error_event, image_stats, images_response, partial_event, sse
from specdec.serve.render import encode

#: how often a waiting handler looks whether its client is still there (s)
POLL_S = 0.25
GONE, KEEPALIVE = object(), object()


def client_gone() -> APIError:
    return APIError(499, "the client closed the request", None, "client_closed")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status, headers=error.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, a 413 past `limit` bytes (declared or sent); a 499 when the client goes
    away before it has sent the whole body (not an error of the server's: nothing to log)."""
    too_large = APIError(413, f"the body is larger than {limit} bytes", None, "body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, "Content-Length is not a number", None, "invalid_header")
        if int(declared) > limit:
            raise too_large
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise client_gone() from None
    return b"".join(chunks)


class EventReader:
    """A request's events from its asyncio queue, watching its client meanwhile. One pending
    `get` is kept across waits, so that no event is lost to a timeout."""

    def __init__(self, events: asyncio.Queue, request: Request, keepalive_s: Optional[float] = None):
        self.events, self.request, self.keepalive_s = events, request, keepalive_s
        self._getter: Optional[asyncio.Future] = None

    async def next(self):
        """The next event, GONE when the client has gone, KEEPALIVE after `keepalive_s` of quiet."""
        quiet = 0.0
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.events.get())
            done, _ = await asyncio.wait({self._getter}, timeout=POLL_S)
            if done:
                getter, self._getter = self._getter, None
                return getter.result()
            if await self.request.is_disconnected():
                return GONE
            quiet += POLL_S
            if self.keepalive_s is not None and quiet >= self.keepalive_s:
                return KEEPALIVE

    def close(self) -> None:
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None


def _stats(event: ImageReady) -> dict:
    return image_stats(event.j, event.finished, event.latency_s, event.first_partial_s)


async def _encode(pixels, plan) -> str:
    return await anyio.to_thread.run_sync(encode, pixels, plan.output_format, plan.output_compression)


async def collect(service, job: Job, events: asyncio.Queue, request: Request):
    """Wait for every image of the request, then answer with all of them (OpenAI's response with
    specdec's statistics); an error event ends it with that error."""
    plan, ready = job.plan, {}
    reader = EventReader(events, request)
    try:
        while len(ready) < plan.n:
            event = await reader.next()
            if event is GONE:
                service.metrics.request_done("cancelled")
                return error_response(client_gone())
            if isinstance(event, Failed):
                service.metrics.request_done(event.error.outcome)
                return error_response(event.error)
            if isinstance(event, ImageReady):
                ready[event.j] = event
    finally:
        reader.close()
        if len(ready) < plan.n:
            service.loop.cancel(job)
    items = []
    for j in range(plan.n):
        item = {"b64_json": await _encode(ready[j].finished.image, plan)}
        if plan.return_tokens:
            item["tokens"] = ready[j].finished.tokens.tolist()
        items.append(item)
    service.metrics.request_done("ok")
    body = images_response(plan, int(time.time()), items, [_stats(ready[j]) for j in range(plan.n)],
                           service.tokens_per_image)
    return JSONResponse(body)


async def started(service, job: Job, events: asyncio.Queue, request: Request) -> Optional[JSONResponse]:
    """Wait until the request's images are on their engine (None), so that a request the engine
    refuses (an option that does not fit the models) is answered with its status before a stream
    begins; else the error response (499 when the client went away meanwhile). A wait past the
    keep-alive interval (a warm-up, every engine busy) begins the stream anyway (None), whose
    keep-alive lines then hold proxies open: a refusal after that is an `error` event."""
    reader = EventReader(events, request, service.config.keepalive_s)
    try:
        event = await reader.next()
    finally:
        reader.close()
    if isinstance(event, Started) or event is KEEPALIVE:
        return None
    if isinstance(event, Failed):
        service.metrics.request_done(event.error.outcome)
        return error_response(event.error)
    service.loop.cancel(job)
    service.metrics.request_done("cancelled")
    return error_response(client_gone())


async def event_stream(service, job: Job, events: asyncio.Queue, request: Request):
    """The request's server-sent events: `image_generation.partial_image` as partial images form,
    `image_generation.completed` for each image, `error` if it fails; a comment line on a quiet
    stream (proxies keep it open, and a server that only notices a gone client when it writes
    notices it)."""
    plan, done, outcome = job.plan, 0, None
    reader = EventReader(events, request, service.config.keepalive_s)
    try:
        while done < plan.n:
            event = await reader.next()
            if event is GONE:
                return
            if event is KEEPALIVE:
                yield b": keep-alive\n\n"
            elif isinstance(event, Failed):
                outcome = event.error.outcome
                yield error_event(event.error)
                return
            elif isinstance(event, PartialImage):
                data = partial_event(plan, event.j, event.partial_index, await _encode(event.pixels, plan),
                                     int(time.time()))
                yield sse(data["type"], data)
            elif isinstance(event, ImageReady):
                tokens = event.finished.tokens.tolist() if plan.return_tokens else None
                data = completed_event(plan, event.j, await _encode(event.finished.image, plan), int(time.time()),
                                       _stats(event), service.tokens_per_image, tokens)
                # A client gone while the image was encoded (in a thread, which a cancellation
                # waits for) is cancelled here, before its image can count as sent.
                await anyio.lowlevel.checkpoint()
                yield sse(data["type"], data)
                done += 1
    finally:
        reader.close()
        if done < plan.n:
            service.loop.cancel(job)     # (a failed request's images are gone already: no-op)
        service.metrics.request_done(outcome or ("ok" if done == plan.n else "cancelled"))


__all__ = ["EventReader", "collect", "error_response", "event_stream", "read_body", "started"]
