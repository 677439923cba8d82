"""`specdec serve`: its flags become the server's settings the way `specdec generate`'s become a
decode's; the CLI works without the server's libraries and says what to install."""
import dataclasses
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")

from decoding_models import single_thread  # noqa: E402, F401  (autouse fixture)
from specdec import cli  # noqa: E402
from specdec.decoding import DEFAULT_SAMPLING  # noqa: E402
from specdec.serve.command import config_from_args, flags_from  # noqa: E402
from specdec.serve.config import ModelSpec, ServeConfig  # noqa: E402

TINY = "decoding_models:TinyFamily"


def test_the_flags_become_the_servers_settings():
    flags = flags_from({"method": "ssd", "concurrency": "4", "cfg_scale": 3, "set": ["chunk=4"], "max_queue": 6,
                        "batch_invariant": "true", "family": TINY, "backend": "reference"})
    family, models = ModelSpec(factory=flags["family"], flags=flags).load()
    config = config_from_args(cli.argparse.Namespace(**flags), family)
    assert (config.method, config.concurrency, config.max_queue, config.batch_invariant) == ("ssd", 4, 6, True)
    assert config.options == {"chunk": 4} and models == {}
    assert config.run.sampling == dataclasses.replace(DEFAULT_SAMPLING, cfg_scale=3.0)   # (as generate)
    assert config.run.backend == "reference" and config.run.concurrency is None
    assert config.capacity == 10 and config.run.exact is False
    # --set preset=NAME is the default method's preset (it reached options_for twice: a TypeError)
    flags = flags_from({"method": "ssd", "set": ["preset=published", "chunk=3"], "family": TINY})
    config = config_from_args(cli.argparse.Namespace(**flags), family)
    assert (config.preset, config.options) == ("published", {"chunk": 3})
    flags = flags_from({"method": "sd", "exact": True, "family": TINY})
    assert config_from_args(cli.argparse.Namespace(**flags), family).run.exact is True
    # a compiled server warms its default engine up first, unless told not to; an eager one never
    for given, warm in (({}, False), ({"compile": True}, True), ({"compile": True, "no_warm_up": True}, False)):
        flags = flags_from({"family": TINY, **given})
        assert config_from_args(cli.argparse.Namespace(**flags), family).warm_up is warm


def test_serve_runs_uvicorn_on_the_app_of_its_flags(monkeypatch, capsys):
    import uvicorn

    started = {}

    def run(server):
        c = server.config
        started.update(app=c.app, host=c.host, port=c.port, grace=c.timeout_graceful_shutdown)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert cli.main(["serve", "--family", TINY, "--method", "ar", "--port", "8123", "--model-name", "tiny"]) == 0
    service = started["app"].state.service
    assert (started["host"], started["port"]) == ("127.0.0.1", 8123)
    assert started["grace"] == 65      # (uvicorn's own bound: the drain's 60 s, then room for its 503s)
    assert service.config.model_name == "tiny" and service.config.method == "ar" and service.size == "8x8"
    assert "8x8 images" in capsys.readouterr().out
    assert cli.main(["serve", "--family", TINY, "--method", "ssd", "--set", "preset=published"]) == 0
    assert started["app"].state.service.config.preset == "published"


def test_serve_refuses_bad_flags_in_one_line(capsys):
    assert cli.main(["serve", "--family", TINY, "--batch-size", "2"]) == 2
    assert "--batch-size is not one of its flags" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_n"):
        ServeConfig(concurrency=1, max_queue=0, max_n=2)
    with pytest.raises(ValueError, match="unknown serve setting"):
        ServeConfig().replace(rows=3)
    assert cli.main(["serve", "--family", TINY, "--method", "ssd", "--set", "tau=0.1"]) == 2
    assert "ssd does not take option(s) tau" in capsys.readouterr().err
    for port in ("99999", "0", "http"):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["serve", "--family", TINY, "--port", port])
        assert stopped.value.code == 2
        assert f"argument --port: must be an int in [1, 65535], got '{port}'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        flags_from({"port": 70000})
    # Exact mode with a lossy default method would refuse every request that names none.
    assert cli.main(["serve", "--family", TINY, "--exact"]) == 2
    assert "the default method mulo is not lossless and cannot be exact" in capsys.readouterr().err


def test_without_the_extras_the_cli_works_and_serve_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else find(name, *a))
    assert cli.main(["serve"]) == 2
    assert "pip install 'specdec-image[serve]'" in capsys.readouterr().err
    # Building the parser (every command's --help) imports none of the server's libraries.
    code = ("import sys, specdec.cli; specdec.cli.build_parser(); "
            "print(sorted({'fastapi', 'uvicorn', 'ray'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_serve_refuses_a_model_it_could_not_make_images_of():
    """A server of a text-to-image LlamaGen started, then answered every request with a 400 (it
    takes T5 caption features, not text); one without a pixel decoder is refused too."""
    import types

    from llamagen_models import tiny_t2i
    from specdec.serve.server import Service

    with pytest.raises(ValueError, match="takes T5 caption features"):
        Service(types.SimpleNamespace(target=tiny_t2i(), tokenizer=object()), ServeConfig())
    with pytest.raises(ValueError, match="no pixel decoder .* GLM-Image and Chameleon bring none"):
        Service(types.SimpleNamespace(target=tiny_t2i(), tokenizer=None), ServeConfig())
