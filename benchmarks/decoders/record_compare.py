"""End-to-end benchmark: run `specdec compare` on the embedded default family and keep its
table, with the machine, date and command, as benchmarks/results/compare-<machine>-<stamp>.json
(rendered into RESULTS.md by make_results.py beside the kernel figures).

    python benchmarks/decoders/record_compare.py [--num-images N] [extra `specdec compare` arguments]
"""
import argparse
import datetime
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import device_description, run_child, save_record  # noqa: E402
from script_args import count  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (SPECDEC_BENCH_IMAGES, run.py's image count, is checked as the flag's default)
    parser.add_argument("--num-images", type=count(2), default=os.environ.get("SPECDEC_BENCH_IMAGES", "30"),
                        help="per method (at least 2: the Frechet distance needs two images)")
    args, extra = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "compare.json")
        cmd = [sys.executable, "-m", "specdec.cli", "compare", "--num-images", str(args.num_images),
               "--seed", "0", "--json", table, "--out-dir", os.path.join(tmp, "png"), "--quiet", *extra]
        started = datetime.datetime.now(datetime.timezone.utc)
        run_child(cmd)     # (specdec compare checks the extra arguments; its error and exit code are the run's)
        with open(table) as f:
            rows = json.load(f)
    record = {
        "kind": "specdec-compare",
        "datetime": started.isoformat(),
        "machine": device_description(),
        "command": "specdec compare " + " ".join(cmd[4:6] + cmd[6:8] + list(extra)),
        "num_images": args.num_images,
        "rows": rows,
    }
    save_record("compare", started, record)

if __name__ == "__main__":
    main()
