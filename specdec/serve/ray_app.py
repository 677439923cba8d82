"""The same app as a Ray Serve deployment: each replica is a process with its own family and
engine loop, built from `specdec serve`'s flags on whichever node Ray places it; Ray's proxies
(one per node) route each request to a replica.

    serve run specdec.serve:app method=ssd concurrency=16 replicas=2     # flags as key=value
    serve run serve_config.yaml       # import_path: specdec.serve:app, args: {replicas: 2, ...}
    specdec serve --ray --replicas 2  # the same from the CLI

A request is decoded whole by one replica, so its images are the ones a single server gives:
image j of seed s depends on (s, j) alone, never on the replica or its neighbours."""
from __future__ import annotations

import re
import signal
from typing import Dict, Optional

from ray import serve

from specdec.serve.command import app_from_flags, flags_from


@serve.deployment(name="specdec")
@serve.ingress()
class SpecdecServer:
    """A replica: the FastAPI app of `specdec serve`'s flags, built when Ray starts the replica
    (its lifespan starts the engine loop, and drains it when Ray stops the replica)."""

    def __init__(self, flags: Dict[str, object]):
        self.flags = flags

    def __serve_build_asgi_app__(self):
        return app_from_flags(self.flags)


def deployment_options(flags: Dict[str, object]) -> dict:
    """Replicas, what each reserves, and how many requests Ray lets one hold: as many as it
    accepts images (its rows and queue), so that Ray's router, not the replica, holds the rest."""
    runtime: Dict[str, object] = {"num_cpus": flags["replica_cpus"]}
    if str(flags.get("device", "cpu")).startswith("cuda"):
        runtime["num_gpus"] = 1
    rows = flags.get("concurrency") or 8
    return {"num_replicas": flags["replicas"], "ray_actor_options": runtime,
            "max_ongoing_requests": rows + flags["max_queue"],
            "graceful_shutdown_timeout_s": flags["drain_timeout"] + 5}


def app(args: Optional[Dict[str, object]] = None):
    """The Ray Serve application (`serve run specdec.serve:app key=value ...`): `args` are
    `specdec serve`'s flags by name (replicas=2, method="ssd", concurrency=16, model=PATH, ...)."""
    flags = flags_from(dict(args or {}))
    return SpecdecServer.options(**deployment_options(flags)).bind(flags)


def serve_forever(flags: Dict[str, object]) -> int:
    """`specdec serve --ray`: join (or start) a Ray cluster, deploy, and serve until interrupted
    (Ctrl-C or SIGTERM); a replica that cannot start is a ValueError with its own error."""
    import ray

    ray.init(address=flags.get("ray_address"))
    # SIGTERM (systemd, `docker stop`) ends the deployment as Ctrl-C does: under Ray's own handler the
    # command exited without serve.shutdown, and a local cluster's processes outlived it.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.start(http_options={"host": flags["host"], "port": flags["port"]})
        application = SpecdecServer.options(**deployment_options(flags)).bind(flags)
        print(f"specdec serve --ray: {flags['replicas']} replica(s) on http://{flags['host']}:{flags['port']}")
        try:
            serve.run(application, name="specdec", route_prefix="/", blocking=True)
        except RuntimeError as e:   # (Ray says only that the deployment failed: the replica says why)
            raise ValueError(replica_error() or str(e)) from None
    except KeyboardInterrupt:
        pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def replica_error() -> Optional[str]:
    """Why the deployment's replicas failed to start: the last error their status message holds
    (a replica's traceback ends in it), e.g. the ValueError of a flag its models do not take."""
    try:
        message = serve.status().applications["specdec"].deployments["specdec"].message
    except Exception:      # (no status to read: Ray's own message stands)
        return None
    return last_error(message)


def last_error(text: str) -> Optional[str]:
    """The message of the last `SomeError: message` line of a traceback's text, or None."""
    found = [m.group(2) for m in re.finditer(r"^\s*([\w.]+(?:Error|Exception)): (.+)$", text or "", re.MULTILINE)]
    return found[-1] if found else None


__all__ = ["SpecdecServer", "app", "deployment_options", "last_error", "replica_error", "serve_forever"]
