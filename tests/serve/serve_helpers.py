"""Helpers of the server's tests: the app in process (its lifespan, an httpx client over ASGI),
a real uvicorn on a free loopback port, and the library's images to compare with."""
import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import torch

from specdec import decoding
from specdec.numerics import batch_invariant
from specdec.serve.render import decode_b64
from specdec.images import to_uint8

#: what every bit-exact comparison runs on
EXACT = dict(backend="reference", batch_invariant=True)
#: a bound on any wait of these tests (s)
LIMIT_S = 60


@contextlib.asynccontextmanager
async def serving(app):
    """The app started (its engine loop running) and an httpx client on it; drained on exit."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://specdec.test", timeout=LIMIT_S) as client:
            yield client


def run(coro):
    """Run a coroutine to its end, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, LIMIT_S))


def library_images(fam, method: str, class_id: int, n: int, seed: int, first_index: int = 0, **options):
    """(tokens [n, H, W], uint8 pixels [n, h, w, C]) of `decode` for the images a request of n
    images of seed `seed` must give: images first_index .. first_index + n - 1 of that seed."""
    with batch_invariant():
        out = decoding.decode(method, fam, torch.full((n,), class_id), seed=seed, first_index=first_index,
                              backend="reference", **options)
    return out.tokens, to_uint8(out.images)


def served_pixels(b64: str) -> torch.Tensor:
    return decode_b64(b64)


def sse_events(text: str) -> list:
    """(event, data) of each server-sent event of a response body."""
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith(":")]
        if not lines:
            continue
        event = next(line[7:] for line in lines if line.startswith("event: "))
        data = json.loads(next(line[6:] for line in lines if line.startswith("data: ")))
        out.append((event, data))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_server(app):
    """The app under a real uvicorn on 127.0.0.1 (a thread of this process), as `specdec serve` runs
    it (`draining_server`); yields its base URL. Stopped as uvicorn stops on a signal: the drain
    begins, the connections close, then the lifespan's shutdown."""
    import uvicorn

    from specdec.serve.command import draining_server

    port = free_port()
    server = draining_server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                             app.state.service.loop)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + LIMIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(LIMIT_S)


def wait_until(predicate, what: str, limit_s: float = LIMIT_S) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
