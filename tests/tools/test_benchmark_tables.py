"""benchmarks/make_results.py: every table's speed-up column is against the group's baseline
measured in the same run (the reference backend for kernels, `ar` for the decoders), and the
decoders plot (decoders.png) shows the end-to-end run with the most images."""
import importlib.util
import os

import pytest

from helpers import ROOT  # noqa: E402


def _make_results():
    spec = importlib.util.spec_from_file_location("make_results", os.path.join(ROOT, "benchmarks", "make_results.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench(group, backend, median, **extra):
    return {"group": group, "name": backend, "stats": {"median": median}, "extra_info": dict(backend=backend, **extra)}


def test_ratios_are_against_the_groups_baseline():
    mr = _make_results()
    data = {"datetime": "2026-11-29T00:00:00", "machine_info": {"specdec_device": "test machine"},
            "benchmarks": [_bench("op A", "reference", 2.0), _bench("op A", "cpu", 0.5),
                           _bench("decode", "mulo", 0.25, baseline=False), _bench("decode", "ar", 1.0, baseline=True),
                           _bench("decode", "sd", 2.0, baseline=False)]}
    text = "\n".join(mr.render_run(data, "x.json"))
    assert "| cpu | 500.00 ms | 4.00x |" in text
    assert "speed-up vs ar" in text and "| mulo | 250.00 ms | 4.00x |" in text and "| sd | 2.00 s | 0.50x |" in text
    assert "baseline" not in text


def test_the_peers_table_leads_against_the_compiled_reference_and_shares_the_copy_bandwidth():
    mr = _make_results()
    case = "kernel peers pool_probs N1024 V16384 top_k=0"
    data = {"datetime": "2026-12-02T06:00:00", "machine_info": {
                "specdec_device": "test machine", "specdec_cpu_limits": {"copy_bandwidth_gbs": 20.0, "threads": 2}},
            "benchmarks": [_bench(case, "torch.compile(reference)", 0.060, baseline=True),
                           _bench(case, "specdec cpu", 0.015, gbs=8.0, copy_share=0.4),
                           _bench(case, "specdec reference", 0.300),
                           _bench("kernel peers tree_attention x", "sdpa dense mask", 0.003)]}
    text = "\n".join(mr.render_peers(data, "peers-x.json"))
    assert "copy bandwidth 20.0 GB/s (read + write) with 2 threads" in text
    assert ("| pool_probs N1024 V16384 top_k=0 | 15.00 ms (cpu) | 60.00 ms | 4.00x | 8.0 | 40% | "
            "specdec reference 300.00 ms |") in text
    assert "tree_attention" not in text                  # a case without a specdec entry has no line


def test_run_py_writes_the_peers_to_a_file_of_their_own(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_run", os.path.join(ROOT, "benchmarks", "run.py"))
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    calls = []
    monkeypatch.setattr(run, "_call", lambda cmd, **kw: calls.append(cmd) or 0)
    monkeypatch.setattr(run, "machine_tag", lambda: "m")
    assert run.main(["--peers", "-k", "pool"]) == 0
    peers_cmd = calls[0]
    assert run.PEERS in peers_cmd and "-k" in peers_cmd and "--peers" not in peers_cmd
    assert os.path.basename(next(a for a in peers_cmd if a.startswith("--benchmark-json="))).startswith("peers-m-")
    assert not any("record_compare" in str(c) for c in calls)   # the peers run has no end-to-end step
    calls.clear()
    monkeypatch.setenv("SPECDEC_BENCH_E2E", "0")
    assert run.main([]) == 0
    assert any(a.startswith("--ignore=") and a.endswith(run.PEERS) for a in calls[0])
    assert os.path.basename(next(a for a in calls[0] if a.startswith("--benchmark-json="))).startswith("m-")


def _compare(path, num_images, when, methods):
    import json

    rows = [{"method": m, "target_forwards": 256.0 / (i + 1), "speedup": 1.0 + i, "fd": 90.0 + 10 * i}
            for i, m in enumerate(methods)]
    with open(path, "w") as f:
        json.dump({"kind": "specdec-compare", "datetime": when, "machine": "test machine",
                   "command": "specdec compare", "num_images": num_images, "rows": rows}, f)
    return str(path)


def test_plot_shows_the_largest_newest_compare_run(tmp_path):
    mr = _make_results()
    methods = ["ar", "sd", "mulo"]
    files = [_compare(tmp_path / "a.json", 500, "2026-11-29T00:00:00", methods),
             _compare(tmp_path / "b.json", 500, "2026-11-30T00:00:00", methods),
             _compare(tmp_path / "c.json", 16, "2026-12-01T00:00:00", methods),       # newer, fewer images
             _compare(tmp_path / "d.json", 900, "2026-12-01T00:00:00", ["ar", "ssd"])]  # two methods only
    path, data = mr.plot_source(files)
    assert os.path.basename(path) == "b.json" and data["num_images"] == 500
    pytest.importorskip("matplotlib")
    out = mr.plot_compare(data, "b.json", str(tmp_path / "decoders.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_results_show_the_newest_run_of_each_kind_per_machine_and_index_every_file(tmp_path):
    mr = _make_results()
    methods = ["ar", "sd", "mulo"]
    files = [_compare(tmp_path / "old.json", 500, "2026-11-29T00:00:00", methods),
             _compare(tmp_path / "new.json", 16, "2026-11-30T00:00:00", methods)]
    other = tmp_path / "gpu.json"
    import json

    with open(other, "w") as f:
        json.dump({"kind": "specdec-compare", "datetime": "2026-11-28T00:00:00", "machine": "a GPU",
                   "command": "specdec compare", "num_images": 8, "rows": []}, f)
    files.insert(0, str(other))
    chosen = mr.newest_per_kind(files)
    assert [(k, m, os.path.basename(p)) for k, m, p, _ in chosen] == [("compare", "test machine", "new.json"),
                                                                         ("compare", "a GPU", "gpu.json")]
    index = "\n".join(mr.index_lines(files, {p for _, _, p, _ in chosen}))
    assert "| `old.json` | decoders end to end | test machine | 2026-11-29 00:00 |  |" in index
    assert "| `new.json` | decoders end to end | test machine | 2026-11-30 00:00 | yes |" in index
    assert mr.kind_of({"benchmarks": []}, "peers-cpu2.json") == "kernel-peers"
    assert mr.kind_of({"benchmarks": []}, "cpu2.json") == "kernels"


def test_results_show_each_benchmark_once_newest_first_and_leave_before_runs_to_the_index(tmp_path):
    """Runs of one benchmark (kind and grid) on one machine show once: the newest of those with the
    most methods (a rerun of some of them does not replace the table); a run kept to compare with
    older code, or one of the batching layer the scheduler replaced, shows in the index only; the
    sections run newest first."""
    import json

    mr = _make_results()

    def run(name, when, variant, methods, grid=16, kind="specdec-continuous", budget=None):
        path = tmp_path / name
        with open(path, "w") as f:
            json.dump({"kind": kind, "datetime": when, "machine": "m", "grid": grid, "variant": variant,
                       "num_images": 1, "rows": [{"method": m, "max_tokens_per_pass": budget} for m in methods]}, f)
        return str(path)

    files = [run("old.json", "2026-12-04T00:00:00", "64x64 eager, slots", ["ar", "sd", "mulo", "ssd"], grid=64),
             run("old-compare.json", "2026-12-04T00:00:00", "", ["ar"], grid=64, kind="specdec-compare"),
             run("a.json", "2026-12-06T00:00:00", "16x16 compiled", ["ar", "sd"]),
             run("b.json", "2026-12-07T00:00:00", "16x16 eager", ["ar", "sd", "mulo"]),
             run("c.json", "2026-12-08T00:00:00", "16x16 eager mulo", ["ar", "mulo"]),
             run("d.json", "2026-12-08T01:00:00", "32x32 compiled", ["ar"], grid=32),
             run("e.json", "2026-12-08T02:00:00", "16x16 eager (before: f5f524b)", ["ar", "sd", "mulo", "ssd"]),
             run("f.json", "2026-12-08T03:00:00", "16x16 eager, budgets", ["ar", "sd", "mulo"], budget=16)]
    chosen = [os.path.basename(p) for _, _, p, _ in mr.newest_per_kind(files)]
    # (c reruns some of b's methods; e compares with older code; f, a run of token budgets, is a table
    # beside b's; old measured the batching layer before the scheduler, while a decoder comparison of
    # that date is still the current one of its kind)
    assert chosen == ["f.json", "d.json", "b.json", "old-compare.json"]


def _record_engine():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))     # it imports bench_helpers
    spec = importlib.util.spec_from_file_location("record_engine",
                                                  os.path.join(ROOT, "benchmarks", "decoders", "record_engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cell(method, mode, wall_s, images, target_forwards):
    return {"method": method, "batch_size": 1, "mode": mode, "compile_s": 2.0, "round_trips_per_pass": 0.5,
            "aten_ops_per_pass": 100.0 if mode == "eager" else None, "wall_s": wall_s, "images": images,
            "target_forwards": target_forwards}


def test_an_engine_run_stopped_early_keeps_what_each_cell_measured():
    """record_engine.py saves on SIGTERM (gpu_check.sh's step timeout): cells that timed images
    get their figures, the others none, and a speed-up needs both the cell and its `ar` timed."""
    eng, mr = _record_engine(), _make_results()
    results = {("ar", 1, "eager"): _cell("ar", "eager", 2.0, 4, 1024),
               ("mulo", 1, "eager"): _cell("mulo", "eager", 0.5, 4, 80),
               ("ar", 1, "compiled"): _cell("ar", "compiled", 0.0, 0, 0),          # warmed up, not timed
               ("mulo", 1, "compiled"): _cell("mulo", "compiled", 0.25, 2, 40)}
    rows = {(r["method"], r["mode"]): r for r in eng.engine_rows(results)}
    assert rows["mulo", "eager"]["s_per_image"] == 0.125 and rows["mulo", "eager"]["speedup_vs_ar"] == 4.0
    assert rows["ar", "compiled"]["s_per_image"] is None and rows["ar", "compiled"]["images_per_s"] is None
    assert rows["mulo", "compiled"]["s_per_image"] == 0.125 and rows["mulo", "compiled"]["speedup_vs_ar"] is None
    data = {"kind": "specdec-engine", "datetime": "2026-12-01T00:00:00", "machine": "test machine",
            "command": "python benchmarks/decoders/record_engine.py", "threads": 1, "num_images": 4,
            "rows": list(rows.values()), "stopped_early": True}
    text = "\n".join(mr.render_engine(data, "engine.json"))
    assert "Stopped early by a time limit" in text
    assert "| mulo | 1 | eager | 0.125 | 8.00 | 4.00x | 20.0 | 0.50 | 100 | 2.0 |" in text
    assert "| ar | 1 | compiled | - | - | - | - | 0.50 | - | 2.0 |" in text
    assert "| mulo | 1 | compiled | 0.125 | 8.00 | - | 20.0 |" in text
    del data["stopped_early"]
    assert "Stopped early" not in "\n".join(mr.render_engine(data, "engine.json"))


def test_sigterm_stops_an_engine_run_so_that_it_saves():
    import signal
    import time

    eng = _record_engine()
    before = signal.getsignal(signal.SIGTERM)
    try:
        eng.stop_on_sigterm()
        with pytest.raises(eng.Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)                          # the handler runs at the next bytecode
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_scaling_table_and_plot_show_every_method_by_grid(tmp_path):
    """record_scaling.py's rows (from run_compare's, with the tokens fed from each result's stats)
    render one line per grid and method with its eager and compiled wall times, the options a family
    sets, and the plot."""
    import sys
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("record_scaling",
                                                  os.path.join(ROOT, "benchmarks", "decoders", "record_scaling.py"))
    rs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rs)
    stats = lambda fed: types.SimpleNamespace(stats=types.SimpleNamespace(target_tokens_fed=fed, images=2))  # noqa
    rows = []
    for grid, passes in ((16, 25.0), (32, 40.0)):
        for mode, wall in (("eager", 1.0), ("compiled", 0.5)):
            table = [{"method": "ar", "target_forwards": grid * grid, "wall_s": wall, "speedup": 1.0, "fd": 100.0,
                      "class_accuracy": 0.6},
                     {"method": "mulo", "target_forwards": passes, "wall_s": wall / 4, "speedup": 4.0, "fd": 90.0,
                      "class_accuracy": 0.7}]
            fam = types.SimpleNamespace(options={"mulo": {"tau": 0.02}} if grid == 32 else None)
            rows += rs.scaling_rows(grid, mode, table, {"ar": stats(2 * (grid * grid - 1)), "mulo": stats(2 * 300)},
                                    5.0, fam)
    assert rows[1]["pass_ratio_vs_ar"] == 256 / 25 and rows[1]["tokens_fed_per_image"] == 300
    assert rows[1]["family_options"] == {} and rows[-1]["family_options"] == {"tau": 0.02}
    data = {"kind": "specdec-scaling", "datetime": "2026-12-02T00:00:00", "machine": "test machine",
            "command": "python benchmarks/decoders/record_scaling.py", "threads": 1, "num_images": 2, "rows": rows}
    mr = _make_results()
    text = "\n".join(mr.render_scaling(data, "s.json"))
    assert "| 32x32 | mulo | 40.0 | 300 | 25.60x | 90.0 | 5.0 | 0.700 | 0.250 | 0.125 | 4.00x | 4.00x |" in text
    assert "| 16x16 | ar | 256.0 | 255 | 1.00x |" in text
    assert "Options the family sets (tuned on its own models; every other option at the method's default): " \
           "32x32 mulo: tau=0.02." in text
    pytest.importorskip("matplotlib")
    with open(mr.plot_scaling(data, str(tmp_path / "s.png")), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_real_size_record_runs_and_renders(monkeypatch):
    """benchmarks/decoders/record_real_size.py on LlamaGen-XL's real width cut to one layer (random bf16
    weights): the cost curve (1 token and the whole 24x24 grid), the AR step, one MuLo-SD decode,
    the parameter count at full depth (GPT-XL: 0.77B), and make_results.py's table of it."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("record_real_size",
                                                  os.path.join(ROOT, "benchmarks", "decoders", "record_real_size.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    saved = {}
    monkeypatch.setattr(mod, "save_record", lambda prefix, started, record: saved.update(record=record))
    threads = __import__("torch").get_num_threads()
    try:
        mod.main(["--layers", "1", "--models", "llamagen-xl", "--tokens", "1", "--repeats", "1", "--methods", "mulo"])
    finally:
        __import__("torch").set_num_threads(threads)
    record = saved["record"]
    (m,) = record["models"]
    assert m["name"] == "llamagen-xl" and m["grid"] == [24, 24] and m["layers_full"] == 36
    assert 0.7e9 < m["params_full"] < 0.8e9 and m["rows_per_image"] == 2
    assert [p["tokens"] for p in m["passes"]] == [1, 576] and all(p["s_per_pass"] > 0 for p in m["passes"])
    assert m["ar_step_s"] > 0 and m["peak_memory_gb"] > 0
    assert [d["method"] for d in m["decodes"]] == ["mulo"] and m["decodes"][0]["tokens"] == 576
    text = "\n".join(_make_results().render_real_size(record, "real-size-x.json"))
    assert "| llamagen-xl | 24x24 | 1 / 36 | 0.06B (0.77B) |" in text
    assert "| model | 1 | whole grid |" in text and "(576) |" in text and "| llamagen-xl | mulo |" in text


def test_the_light_load_table_compares_each_method_with_its_own_engine_of_one():
    """A lone request's seconds at each concurrency against the same method at concurrency 1 (not
    against ar), and the rows its target passes fed; the file's kind is its own in the index."""
    mr = _make_results()

    def row(method, c, seconds, rows):
        return {"method": method, "mode": "compiled", "concurrency": c, "engine": "RollingEngine",
                "latency_s": seconds, "target_passes": 99, "rows_per_pass": rows}
    data = {"kind": "specdec-light-load", "datetime": "2026-12-04T18:00:00", "machine": "test machine",
            "command": "python benchmarks/decoders/record_light_load.py", "threads": 1, "num_images": 5, "grid": 16,
            "rows": [row("sd", 16, 0.5, 1.2), row("ar", 1, 0.3, 1.0), row("sd", 1, 0.25, 1.0), row("ar", 16, 0.6, 16)]}
    text = "\n".join(mr.render_light_load(data, "light.json"))
    assert "| sd | compiled | 16 | RollingEngine | 0.500 | 2.00x | 99 | 1.2 |" in text
    assert "| ar | compiled | 16 | RollingEngine | 0.600 | 2.00x | 99 | 16.0 |" in text
    order = [text.index(f"| {m} | compiled | {c} |") for m, c in (("ar", 1), ("sd", 1), ("sd", 16))]
    assert order == sorted(order)
    assert mr.kind_of(data, "light-load-16x16-compiled-x.json") == "light-load"


def test_the_exact_table_shows_acceptance_beside_its_bounds_and_each_load_against_exact_ar():
    mr = _make_results()

    def acc(method, exact, acceptance):
        return {"part": "acceptance", "grid": 16, "method": method, "exact": exact, "options": {"chunk": 4},
                "acceptance": acceptance, "bound_exact": 0.5, "bound_ratio": 0.6, "reached": 100,
                "target_passes": 80.0, "seconds_per_image": 0.7}

    def load(variant, c, rate, same):
        return {"part": "load", "grid": 16, "variant": variant, "concurrency": c, "images": 64,
                "images_per_s": rate, "target_passes": 256.0, "same_as_exact_ar": same, "seconds_per_image": 1 / rate}
    data = {"kind": "specdec-exact", "datetime": "2026-12-05T18:00:00", "machine": "test machine",
            "command": "python benchmarks/decoders/record_exact.py", "threads": 1, "num_images": 16, "load_images": 64,
            "rows": [acc("sd", False, 0.58), acc("sd", True, 0.51), load("ar", 16, 4.0, None),
                     load("ar exact", 16, 3.8, True), load("sd exact adaptive", 16, 3.7, True)]}
    text = "\n".join(mr.render_exact(data, "exact.json"))
    assert "| 16x16 | sd chunk=4 | ratio test | 0.580 | 0.500 | 0.600 | 100 | 80.0 | 0.700 |" in text
    assert "| 16x16 | sd chunk=4 | exact | 0.510 |" in text
    assert "| 16 | sd exact adaptive | 3.70 | 0.97x | 256.0 | yes |" in text
    assert "| 16 | ar | 4.00 | 1.05x | 256.0 | - |" in text
    assert mr.kind_of(data, "exact-cpu2-x.json") == "exact"


def test_the_serving_tables_show_the_newest_eager_and_compiled_runs_and_name_exact_mode(tmp_path):
    """record_serve.py's runs: the newest eager run and the newest compiled one are two tables (a
    run from before `compile` was recorded was eager, and a newer eager run replaces it), and a
    method in exact mode is named so."""
    import json

    mr = _make_results()
    cell = {"images_per_s": 2.0, "latency_p50_s": 0.5, "latency_p99_s": 1.0, "first_partial_p50_s": 0.25}

    def run(name, when, methods, compiled=None):
        rows = [{"method": m.split("+")[0], "concurrency": 4, "server": cell, "stream": cell} for m in methods]
        record = {"kind": "specdec-serve", "datetime": when, "machine": "m", "command": "record_serve.py",
                  "threads": 1, "rate": 16.0, "requests": 32, "rows": rows}
        if compiled is not None:        # (None: written before record_serve.py recorded it and exact mode)
            record["compile"] = compiled
            for row, m in zip(rows, methods):
                row["exact"] = m.endswith("+exact")
        path = tmp_path / name
        with open(path, "w") as f:
            json.dump(record, f)
        return str(path)

    files = [run("old.json", "2026-12-05T00:00:00", ["ar", "mulo"]),
             run("eager.json", "2026-12-07T00:00:00", ["ar", "sd+exact", "mulo"], compiled=False),
             run("compiled.json", "2026-12-07T01:00:00", ["ar", "sd+exact", "mulo"], compiled=True)]
    chosen = mr.newest_per_kind(files)
    assert [os.path.basename(p) for _, _, p, _ in chosen] == ["compiled.json", "eager.json"]
    compiled, eager = ("\n".join(mr.render_serve(data, os.path.basename(p))) for _, _, p, data in chosen)
    assert "16x16, compiled;" in compiled and "| sd (exact) | 4 | 2.00 / 2.00 | 0.50 / 0.50 |" in compiled
    assert "16x16, eager;" in eager and "| ar | 4 |" in eager and "| mulo | 4 |" in eager
    old = "\n".join(mr.render_serve(json.load(open(files[0])), "old.json"))
    assert "16x16, eager;" in old and "(exact) |" not in old
