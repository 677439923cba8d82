"""End-to-end benchmark: run `specdec compare` on the embedded default family and keep its
table, with the machine, date and command, as benchmarks/results/compare-<machine>-<stamp>.json
(rendered into RESULTS.md by make_results.py beside the kernel figures).

    python benchmarks/decoders/record_compare.py [--num-images N] [extra `specdec compare` arguments]
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # benchmarks/: bench_helpers, run

from bench_helpers import device_description, save_record  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=int(os.environ.get("SPECDEC_BENCH_IMAGES", "30")))
    args, extra = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "compare.json")
        cmd = [sys.executable, "-m", "specdec.cli", "compare", "--num-images", str(args.num_images),
               "--seed", "0", "--json", table, "--out-dir", os.path.join(tmp, "png"), "--quiet", *extra]
        started = datetime.datetime.now(datetime.timezone.utc)
        subprocess.run(cmd, check=True)
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
