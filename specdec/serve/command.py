"""`specdec serve`: its flags (the model and decode flags are `specdec generate`'s, from the CLI's
own parser), the server's settings built from them, and the two ways to run it: uvicorn in this
process, or a Ray Serve deployment of replicas (`--ray`).

Every serving process, this one or a Ray replica, builds its family and settings from the same
flags (`app_from_flags`), so a replica on another node needs only the flags, not the models."""
from __future__ import annotations

import argparse
import asyncio
import math
import os
from typing import Dict, List

from specdec.cli_flags import common_flags, model_file_flags, parse_sets, run_settings
from specdec.serve.config import ModelSpec, ServeConfig

#: the serve defaults that differ from `specdec generate`'s
DEFAULT_CONCURRENCY = 8
DEFAULT_PORT = 8000


def port_number(text: str) -> int:
    """A --port value: an int in [1, 65535]. (uvicorn, given 99999, reports it is running and
    stops at once with status 0.)"""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an int in [1, 65535], got {text!r}")
    return port


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `specdec serve` itself (argparse only: no server library is imported)."""
    from specdec.decoding import METHODS
    from specdec.settings import BACKENDS

    p.add_argument("--method", default="mulo", help=f"the method of requests that name none: {', '.join(METHODS)}")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="an option of --method, e.g. tau=0.1")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=f"TCP port, 1 to 65535 ({DEFAULT_PORT})")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: from --model or "
                   "specdec-embedded)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="images accepted beyond the --concurrency rows before requests get 429")
    p.add_argument("--max-n", type=int, default=10, help="the most images one request may ask for")
    p.add_argument("--max-body", type=int, default=64 * 1024, help="the largest request body in bytes (larger: 413)")
    p.add_argument("--max-engines", type=int, default=4,
                   help="engines alive at once (one per method, options and sampling that requests ask for)")
    p.add_argument("--partial-every", type=int, default=4,
                   help="engine steps between looks for partial images (each look reads the device once)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds accepted requests may still run at shutdown")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="kernel backend (default: by device)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="with --compile, take requests at once: the default engine does not first decode throwaway "
                        "images to make its graphs (each new shape then stalls the requests running for its compile)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="decode under specdec.numerics.batch_invariant() (bit-exact checks; slow)")
    p.add_argument("--family", default=None, metavar="MODULE:CALLABLE",
                   help="serve the family this callable returns instead of the embedded one or --model")
    r = p.add_argument_group("Ray Serve (pip install 'specdec-image[ray]'; docs/serving.md)")
    r.add_argument("--ray", action="store_true", help="serve as a Ray Serve deployment, one engine per replica")
    r.add_argument("--replicas", type=int, default=1, help="with --ray: replicas (each its own process and engine)")
    r.add_argument("--ray-address", default=None,
                   help="with --ray: the cluster to join ('auto': the one this node belongs to; default: a new "
                        "local one)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="with --ray: CPUs Ray reserves per replica")


def serve_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `specdec serve`: its own, then the model's and the decode's (`specdec
    generate`'s, from `specdec.cli_flags`)."""
    add_arguments(p)
    model_file_flags(p.add_argument_group("a model of your own (docs/models.md)"))
    common_flags(p)


def config_from_args(args, family) -> ServeConfig:
    """The server's settings from the flags; the run settings through the CLI's own `run_settings`
    (the family's sampling under the sampling flags, as `specdec generate`)."""
    import dataclasses

    if args.batch_size != 1:
        raise ValueError("serve decodes with --concurrency rows per engine; --batch-size is not one of its flags")
    run = run_settings(args, family)
    run = dataclasses.replace(run, concurrency=None, backend=args.backend, progress=None)
    name = args.model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else "specdec-embedded")
    options = parse_sets(args.set, per_method=False)
    preset = options.pop("preset", None)      # (--set preset=NAME: the default method's preset, as generate takes it)
    return ServeConfig(method=args.method, concurrency=args.concurrency or DEFAULT_CONCURRENCY, model_name=name,
                       run=run, options=options, preset=preset, max_queue=args.max_queue,
                       max_n=args.max_n, max_body_bytes=args.max_body, max_engines=args.max_engines,
                       partial_every=args.partial_every, batch_invariant=args.batch_invariant,
                       drain_timeout_s=args.drain_timeout, warm_up=run.compile and not args.no_warm_up)


def spec_from_args(args) -> ModelSpec:
    return ModelSpec(factory=args.family, flags=dict(vars(args)))


def app_from_flags(flags: Dict[str, object]):
    """The FastAPI app a serving process runs, built from `specdec serve`'s flags (a Ray replica's way in)."""
    from specdec.serve.server import create_app

    args = argparse.Namespace(**flags)
    family, models = spec_from_args(args).load()
    return create_app(family, config_from_args(args, family), models=models)


def flags_from(values: Dict[str, object]) -> Dict[str, object]:
    """`specdec serve`'s flags from a dict of them (Ray's `serve run ... key=value` and a config
    file's `args`): parsed by its own parser, so values in strings get their types and checks."""
    argv: List[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            if value is True or str(value).lower() == "true":
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="specdec serve")
    serve_flags(parser)
    return dict(vars(parser.parse_args(argv)))


def run(args) -> int:
    """`specdec serve` in this process, under uvicorn (`--ray`: `specdec.serve.ray_app.serve_forever`)."""
    import uvicorn

    app = app_from_flags(dict(vars(args)))
    service = app.state.service
    print(f"specdec serve: {service.config.model_name} ({service.size} images), {service.config.method} by "
          f"default, {service.config.concurrency} rows per engine, on http://{args.host}:{args.port}")
    # (uvicorn's own bound on the wait for open connections: past the drain, with room for its 503s)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                            timeout_graceful_shutdown=math.ceil(service.config.drain_timeout_s) + 5)
    draining_server(config, service.loop).run()
    return 0


def draining_server(config, loop):
    """A uvicorn server that drains `loop` (`EngineLoop.close`) as soon as it begins to shut down.
    uvicorn waits for the requests in flight before it runs the app's lifespan shutdown, where the
    drain would begin: until they had all finished, without a bound, so --drain-timeout never
    applied. Here what is unfinished at the drain timeout gets its 503, which closes its connection."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            drain = asyncio.get_running_loop().run_in_executor(None, loop.close)
            try:
                await super().shutdown(sockets)
            finally:
                if self.force_exit:     # (a second Ctrl-C: exit now, as uvicorn does)
                    loop.end_drain()
                await drain

    return DrainingServer(config)


__all__ = ["add_arguments", "app_from_flags", "config_from_args", "draining_server", "flags_from", "run",
           "spec_from_args"]
