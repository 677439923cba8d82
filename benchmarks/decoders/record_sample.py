"""End-to-end benchmark of `specdec sample`: the same run with K processes under torchrun (gloo
on CPU) and with one plain process, on the embedded default family; checks that both wrote the
same samples.npz, and keeps wall time and images/s of each, with the machine, date, commands and
the load average around each run, as benchmarks/results/sample-<method>-<N>-<stamp>.json
(rendered into RESULTS.md by make_results.py).

    python benchmarks/decoders/record_sample.py [--method mulo] [--num-images 1000] [--nproc 2] [--keep DIR]
"""
import argparse
import datetime
import filecmp
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import device_description, run_child  # noqa: E402
from script_args import count, output_folder  # noqa: E402


def _run(label, cmd, out_dir):
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    run_child(cmd)
    wall = time.perf_counter() - t0
    with open(os.path.join(out_dir, "stats.json")) as f:
        stats = json.load(f)
    total = stats["total"]
    print(f"{label}: {wall:.1f} s end to end, {total['images_per_s']:.2f} images/s in the run", flush=True)
    return {"label": label, "command": " ".join(["python" if c == sys.executable else c for c in cmd]),
            "processes": stats["world_size"], "end_to_end_s": wall, "end_to_end_images_per_s": total["images"] / wall,
            "run_wall_s": total["wall_s"], "run_images_per_s": total["images_per_s"],
            "target_forwards_per_image": total["target_forwards_per_image"],
            "per_rank": [{k: r[k] for k in ("rank", "images", "wall_s", "images_per_s")} for r in stats["per_rank"]],
            "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
            "loadavg_1_5_15_after": [round(x, 2) for x in os.getloadavg()]}


def main(argv=None):
    from specdec.decoding import METHODS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=METHODS, default="mulo")
    parser.add_argument("--num-images", type=count(1), default="1000")
    parser.add_argument("--nproc", type=count(1), default="2", help="processes under torchrun")
    parser.add_argument("--keep", type=output_folder, default=None,
                        help="write the two sample directories here (default: a temporary folder)")
    args = parser.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        many, one = (os.path.join(root, f"{args.method}-{args.num_images}-{k}proc") for k in (args.nproc, 1))
        sample = ["-m", "specdec.cli", "sample", "--method", args.method, "--num-images", str(args.num_images),
                  "--seed", "0", "--device", "cpu", "--quiet"]
        runs = [_run(f"{args.nproc} processes (torchrun, gloo)",
                     [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                      str(args.nproc), *sample, "--out", many], many),
                _run("1 process", [sys.executable, *sample, "--out", one], one)]
        identical = filecmp.cmp(os.path.join(many, "samples.npz"), os.path.join(one, "samples.npz"), shallow=False)
    record = {"kind": "specdec-sample", "datetime": started.isoformat(), "machine": device_description(),
              "cpu_count": os.cpu_count(), "method": args.method, "num_images": args.num_images, "seed": 0,
              "family": "embedded default (specdec.models.default())", "npz_identical": identical, "runs": runs}
    stamp = started.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(os.path.dirname(HERE), "results", f"sample-{args.method}-{args.num_images}-{stamp}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}; samples.npz identical across the two runs: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
