"""benchmarks/make_results.py: every table's speed-up column is against the group's baseline
measured in the same run (the reference backend for kernels, `ar` for the decoders)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
