"""benchmarks/script_args.py, the argparse types of the benchmark scripts, and the scripts' bad
command lines: each refused while its arguments are parsed, before any model is built or anything
measured, by argparse's own error naming the flag (exit 2, no traceback), and no record written.

The scripts run from a copy of benchmarks/ (its results/ empty): a script that wrongly ran would
write its record there, never into the repository's results."""
import argparse
import asyncio
import importlib.util
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from helpers import ROOT

BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)

import script_args  # noqa: E402


def refused(parse, text: str) -> str:
    """The message `parse` refuses `text` with."""
    with pytest.raises(argparse.ArgumentTypeError) as e:
        parse(text)
    return str(e.value)


# ---- the types ------------------------------------------------------------------------------

def test_count_takes_ints_within_its_bounds():
    assert script_args.count(1)("3") == 3
    assert script_args.count(0)("0") == 0
    assert refused(script_args.count(1), "0") == "must be an int >= 1, got 0"
    assert refused(script_args.count(1, 4), "5") == "must be an int in [1, 4], got 5"
    assert "is not an int" in refused(script_args.count(1), "two")


def test_names_are_known_words_once_each():
    modes = script_args.names(("eager", "compiled"), "mode")
    assert modes("compiled,eager") == ["compiled", "eager"]
    assert modes("eager,") == ["eager"]                 # (a trailing comma is harmless)
    assert refused(modes, "eager,nosuch,warp") == "unknown mode nosuch, warp; choose from eager, compiled"
    assert refused(modes, "eager,eager") == "mode eager given twice"
    assert "give at least one mode" in refused(modes, ",")


def test_ints_take_a_minimum_or_a_set_of_choices():
    assert script_args.ints(1)("1,16") == [1, 16]
    assert refused(script_args.ints(1), "1,0") == "must be an int >= 1, got 0"
    assert refused(script_args.ints(1, what="batch size"), "4,4") == "batch size 4 given twice"
    grids = script_args.ints(choices=(8, 16, 32), what="grid")
    assert grids("8,32") == [8, 32]
    assert refused(grids, "16,7") == "unsupported grid 7; choose from 8, 16, 32"
    assert script_args.ints(1, distinct=False)("16,16") == [16, 16]      # (counts per family may repeat)


def test_items_read_each_entry_with_the_scripts_own_type():
    budgets = script_args.items(lambda t: None if t == "none" else script_args.count(1)(t), "budget")
    assert budgets("none,256") == [None, 256]
    assert refused(budgets, "none,none") == "budget None given twice"
    assert refused(budgets, "0") == "must be an int >= 1, got 0"


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "fast"])
def test_positive_float_refuses_what_would_measure_nothing(text):
    refused(script_args.positive_float, text)


def test_positive_float_takes_a_rate():
    assert script_args.positive_float("0.5") == 0.5


def test_device_name_is_checked_by_specdec():
    assert script_args.device_name("cpu") == "cpu"
    assert "specdec runs on cpu or cuda" in refused(script_args.device_name, "meta")
    if not torch.cuda.is_available():
        assert refused(script_args.device_name, "cuda") == "cuda: CUDA is not available on this machine"


def test_thread_count_lies_between_one_and_the_cpus():
    assert script_args.thread_count("1") == 1
    most = os.cpu_count()
    assert refused(script_args.thread_count, "0") == f"must be an int in [1, {most}], got 0"
    refused(script_args.thread_count, str(most + 1))


def test_output_file_needs_a_writable_folder_that_exists(tmp_path):
    assert script_args.output_file(str(tmp_path / "x.json")) == str(tmp_path / "x.json")
    missing = tmp_path / "missing" / "x.json"
    assert "does not exist" in refused(script_args.output_file, str(missing))
    assert not missing.parent.exists()                  # (a mistyped folder is not made)
    assert "is a folder" in refused(script_args.output_file, str(tmp_path))
    assert "is empty" in refused(script_args.output_file, "")


def test_output_folder_is_made_and_a_file_refused(tmp_path):
    assert script_args.output_folder(str(tmp_path / "new")) == str(tmp_path / "new")
    assert (tmp_path / "new").is_dir()
    (tmp_path / "file").write_text("")
    assert "is a file, not a folder" in refused(script_args.output_folder, str(tmp_path / "file"))


def test_argparse_names_the_flag_and_exits_2(capsys):
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--modes", type=script_args.names(("eager",), "mode"), default="eager")
    assert p.parse_args([]).modes == ["eager"]          # (a string default goes through its type)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--modes", "nosuch"])
    assert e.value.code == 2
    assert "x: error: argument --modes: unknown mode nosuch" in capsys.readouterr().err


# ---- the scripts' bad command lines ---------------------------------------------------------

@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """benchmarks/ without its results (an empty results/), the scripts' own folder structure."""
    root = tmp_path_factory.mktemp("repo")
    shutil.copytree(BENCHMARKS, root / "benchmarks",
                    ignore=shutil.ignore_patterns("results", "*.png", "RESULTS.md", "__pycache__"))
    (root / "benchmarks" / "results").mkdir()
    return root


#: (script, arguments, what the error names): each must stop while its arguments are parsed
BAD = [
    ("decoders/record_engine.py", ["--modes", "nosuch"], "--modes"),
    ("decoders/record_engine.py", ["--methods", "nosuch"], "--methods"),
    ("decoders/record_engine.py", ["--threads", "0"], "--threads"),
    ("decoders/record_engine.py", ["--batch-sizes", "0"], "--batch-sizes"),
    ("decoders/record_engine.py", ["--num-images", "5", "--batch-sizes", "1,16"], "--num-images"),
    ("decoders/record_light_load.py", ["--modes", "nosuch"], "--modes"),
    ("decoders/record_light_load.py", ["--requests", "0"], "--requests"),
    ("decoders/record_continuous.py", ["--batchings", "nosuch"], "--batchings"),
    ("decoders/record_continuous.py", ["--num-images", "0"], "--num-images"),
    ("decoders/record_scaling.py", ["--methods", "nosuch"], "--methods"),
    ("decoders/record_scaling.py", ["--grids", "7"], "--grids"),
    ("decoders/record_exact.py", ["--parts", "nosuch"], "--parts"),
    ("decoders/record_exact.py", ["--images", "0"], "--images"),
    ("decoders/record_graph_time.py", ["--num-images", "0"], "--num-images"),
    ("decoders/record_real_size.py", ["--tokens", "0"], "--tokens"),
    ("decoders/check_alone.py", ["--grid", "7"], "--grid"),
    ("decoders/check_exact.py", ["--grids", "16,32", "--images", "4"], "--images"),
    ("decoders/record_compare.py", ["--num-images", "0"], "--num-images"),
    ("decoders/record_compare.py", ["--bogus"], "--bogus"),      # (specdec compare's own error, its exit code)
    ("decoders/record_sample.py", ["--nproc", "0"], "--nproc"),
    ("decoders/record_sample.py", ["--keep", "__file__"], "--keep"),
    ("serve/record_serve.py", ["--methods", "nosuch"], "--methods"),
    ("serve/record_serve.py", ["--rate", "-1", "--time-limit", "-1"], "--rate"),
    ("serve/loadgen.py", ["--requests", "0"], "--requests"),
    ("machine/device_limits.py", ["missing/limits.json"], "out"),
    ("machine/device_limits.py", ["."], "out"),
    ("machine/machine_code.py", ["--bogus"], "--bogus"),
    ("kernels/pool_paths.py", ["out.json", "--rows", "0"], "--rows"),
    ("make_results.py", ["--bogus"], "--bogus"),
]
if not torch.cuda.is_available():
    BAD.append(("decoders/record_continuous.py", ["--device", "cuda"], "--device"))


@pytest.mark.parametrize("script,args,flag", BAD, ids=[f"{s.split('/')[-1]} {' '.join(a)}" for s, a, _ in BAD])
def test_a_bad_value_is_refused_before_anything_runs(copy, script, args, flag):
    path = copy / "benchmarks" / script
    args = [str(path) if a == "__file__" else a for a in args]
    results = copy / "benchmarks" / "results"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # (the timeout only ends a script that wrongly started measuring: the refusal takes seconds)
    proc = subprocess.run([sys.executable, str(path), *args], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "error:" in proc.stderr and flag in proc.stderr.splitlines()[-1], proc.stderr
    assert not list(results.iterdir())
    assert not (copy / "benchmarks" / "RESULTS.md").exists()


# ---- what the parsers cannot see ------------------------------------------------------------

def _module(name: str, *parts):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, *parts))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_make_results_help_writes_nothing(tmp_path, monkeypatch, capsys):
    mr = _module("make_results", "make_results.py")
    monkeypatch.setattr(mr, "HERE", str(tmp_path))
    (tmp_path / "results").mkdir()
    with pytest.raises(SystemExit) as e:
        mr.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
    assert not (tmp_path / "RESULTS.md").exists()


@pytest.mark.parametrize("text,what", [("", "not valid JSON"), ('{"kind": ', "not valid JSON"),
                                       ("[]", "holds a JSON list")])
def test_make_results_names_a_bad_results_file(tmp_path, monkeypatch, text, what):
    mr = _module("make_results", "make_results.py")
    monkeypatch.setattr(mr, "HERE", str(tmp_path))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "bad.json").write_text(text)
    with pytest.raises(SystemExit) as e:
        mr.main([])
    assert str(e.value).startswith(f"make_results.py: {tmp_path / 'results' / 'bad.json'}: {what}")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "RESULTS.md").exists()


def test_run_py_refuses_an_unknown_peers_scope(monkeypatch, capsys):
    run = _module("bench_run", "run.py")
    calls = []
    monkeypatch.setattr(run, "_call", lambda cmd, **kw: calls.append(cmd) or 0)
    monkeypatch.setenv("SPECDEC_PEERS", "nosuch")
    assert run.main(["--peers"]) == 2
    assert not calls
    assert "SPECDEC_PEERS='nosuch' is not one of full, headline" in capsys.readouterr().err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loadgen_counts_refused_requests_as_failed_and_exits_1(capsys):
    pytest.importorskip("httpx")
    loadgen = _module("loadgen", "serve", "loadgen.py")
    url = f"http://127.0.0.1:{_closed_port()}"
    assert loadgen.main(["--url", url, "--requests", "3", "--rate", "1000"]) == 1
    out = capsys.readouterr()
    assert '"failed": 3' in out.out and "every request failed (3: ConnectError" in out.err


def test_loadgen_counts_requests_cut_off_by_the_time_limit():
    pytest.importorskip("httpx")
    loadgen = _module("loadgen", "serve", "loadgen.py")

    async def load():
        async def never_answer(reader, writer):
            await reader.read()             # (until the client gives up and closes)
            writer.close()
        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        spec = loadgen.LoadSpec(requests=3, clients=1, rate=1000.0, time_limit_s=0.5)
        try:
            return await loadgen.run_load(f"http://127.0.0.1:{port}", spec)
        finally:
            server.close()

    summary = asyncio.run(load())["summary"]
    assert summary["images"] == 0 and summary["failed"] == 3
    failures = dict(summary["failures"])
    assert failures.pop(loadgen.NOT_SENT) == 2          # (one client: the other two waited for it)
    # the one in flight: cut off at the limit (or by the client's own timeout, the same limit)
    (why, n), = failures.items()
    assert n == 1 and (why == loadgen.ABANDONED or why.startswith("ReadTimeout")), why
