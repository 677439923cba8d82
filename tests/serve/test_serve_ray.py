"""The app as a Ray Serve deployment on a local Ray cluster of this machine: two replicas, each
its own process and engine, both answering, with the images one server gives (the library's).
Bounded in time: Ray's start, the deployment and the requests."""
import os
import signal
import time

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")

from decoding_models import TinyFamily, single_thread  # noqa: E402, F401  (autouse fixture)
from serve_helpers import LIMIT_S, free_port, library_images, served_pixels  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the whole test, Ray's start included (s)
BOUND_S = 240


class TimeBound:
    """Fails the test when it runs past `seconds` (SIGALRM: the main thread, where pytest runs it)."""

    def __init__(self, seconds: int):
        self.seconds = seconds

    def __enter__(self):
        def expired(signum, frame):
            raise TimeoutError(f"the Ray test ran past {self.seconds} s")

        self.previous = signal.signal(signal.SIGALRM, expired)
        signal.alarm(self.seconds)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)


@pytest.mark.isolated
def test_two_ray_replicas_serve_the_images_of_one_server():
    from specdec.serve.ray_app import app

    # Replicas import the tests' tiny family, and run one thread each (2 cores, 2 replicas).
    env = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), "OMP_NUM_THREADS": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    # One request at a time per replica (one row, no queue): requests sent at once must spread.
    flags = {"family": "decoding_models:TinyFamily", "method": "mulo", "concurrency": 1, "max_queue": 0, "max_n": 1,
             "replicas": 2, "replica_cpus": 0, "backend": "reference", "batch_invariant": True, "threads": 1}
    requests = [(c % 3, 20 + c) for c in range(6)]
    with TimeBound(BOUND_S):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(app(flags), name="specdec", route_prefix="/")
            status = serve.status().applications["specdec"].deployments["specdec"].replica_states
            answers = _send_at_once(f"http://127.0.0.1:{port}", requests)
        finally:
            serve.shutdown()
            ray.shutdown()
    assert status == {"RUNNING": 2}
    assert len({r.headers["x-specdec-server"] for r in answers}) == 2      # both replicas answered
    for (class_id, seed), r in zip(requests, answers):
        assert r.status_code == 200, r.text
        _, pixels = library_images(TinyFamily(), "mulo", class_id, 1, seed)
        assert torch.equal(served_pixels(r.json()["data"][0]["b64_json"]), pixels[0])


def _send_at_once(url: str, requests) -> list:
    import asyncio

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=LIMIT_S) as client:
            return await asyncio.gather(*[client.post("/v1/images/generations",
                                                      json={"prompt": str(c), "seed": s}) for c, s in requests])

    started = time.monotonic()
    answers = asyncio.run(asyncio.wait_for(main(), LIMIT_S))
    assert time.monotonic() - started < LIMIT_S
    return answers


def test_ray_serve_run_takes_the_flags_as_strings():
    """`serve run specdec.serve:app replicas=2 concurrency=3 ...` passes every value as a string:
    the builder parses them as `specdec serve` does, and sizes the deployment from them."""
    import importlib

    from specdec.serve.command import flags_from
    from specdec.serve.ray_app import deployment_options

    builder = getattr(importlib.import_module("specdec.serve"), "app")
    assert callable(builder) and builder.__module__ == "specdec.serve.ray_app"
    flags = flags_from({"replicas": "3", "concurrency": "3", "max_queue": "5", "replica_cpus": "0.5",
                        "batch_invariant": "true", "method": "ssd"})
    assert (flags["replicas"], flags["concurrency"], flags["batch_invariant"], flags["method"]) == (3, 3, True, "ssd")
    options = deployment_options(flags)
    assert options["num_replicas"] == 3 and options["max_ongoing_requests"] == 8
    assert options["ray_actor_options"] == {"num_cpus": 0.5}
    assert builder({"replicas": "2", "family": "decoding_models:TinyFamily"}) is not None


def test_a_replica_that_cannot_start_is_named_by_its_own_error():
    """Ray says only that the deployment failed; `serve --ray` says what the replica raised."""
    from specdec.serve.ray_app import last_error

    message = ("The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n"
               '  File "/x/ray/serve/_private/replica.py", line 9, in initialize\n'
               "ray.exceptions.RayTaskError(ValueError): a wrapper\n"
               "ValueError: zipar cannot run here: window must be an int in [1, W] = [1, 16], got 99\n")
    assert last_error(message) == "zipar cannot run here: window must be an int in [1, W] = [1, 16], got 99"
    assert last_error("Deploying application specdec failed.") is None
