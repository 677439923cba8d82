"""Run the kernel microbenchmarks (benchmarks/*/bench_*.py) with pytest-benchmark, then the
end-to-end `specdec compare` (benchmarks/decoders/record_compare.py; SPECDEC_BENCH_E2E=0 skips it,
SPECDEC_BENCH_IMAGES sets its image count), keep the JSON under benchmarks/results/, and regenerate
benchmarks/RESULTS.md from all kept JSON files.

    python benchmarks/run.py                 # all microbenchmarks and the end-to-end compare
    python benchmarks/run.py -k pool_probs   # extra arguments go to pytest
    python benchmarks/run.py --peers         # the kernels against torch.compile of their reference
                                             # (and SDPA, FlexAttention, FlashInfer): peers-*.json

The peers (kernels/bench_kernel_peers.py) are a run of their own: they time many shapes against
compiled peers, and RESULTS.md shows them as their own table, first. SPECDEC_PEERS=headline keeps
the headline shape (N 1024, V 16384, CFG on).
"""
import datetime
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def machine_tag() -> str:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
    else:
        name = f"cpu{os.cpu_count()}"
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


PEERS = os.path.join("kernels", "bench_kernel_peers.py")
#: SPECDEC_PEERS, the peers' shapes (kernels/bench_kernel_peers.py): every one, or the headline's
PEERS_SCOPES = ("full", "headline")


def _call(cmd, **kw) -> int:
    """`subprocess.call`, but a Ctrl-C or a SIGINT to the process group (gpu_check.sh's timeouts)
    waits for the child, which got it too and stops on its own, writing the JSON of the benchmarks
    it finished (subprocess.call would kill it, and lose them)."""
    proc = subprocess.Popen(cmd, **kw)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


def main(argv):
    peers = "--peers" in argv
    argv = [a for a in argv if a != "--peers"]
    scope = os.environ.get("SPECDEC_PEERS", "full")
    if peers and scope not in PEERS_SCOPES:     # (bench_kernel_peers.py ran the full sweep for any other word)
        print(f"run.py: SPECDEC_PEERS={scope!r} is not one of {', '.join(PEERS_SCOPES)}", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    # make_results.py tells the peers' files from the microbenchmarks' by this prefix.
    out = os.path.join(HERE, "results", f"{'peers-' if peers else ''}{machine_tag()}-{stamp}.json")
    target = [PEERS] if peers else [HERE, f"--ignore={os.path.join(HERE, PEERS)}"]
    cmd = [sys.executable, "-m", "pytest", *target, "-o", "python_files=bench_*.py", "-p", "no:cacheprovider",
           "-q", "--benchmark-only", f"--benchmark-json={out}", "--benchmark-columns=median,iqr,rounds",
           *argv]
    rc = _call(cmd, cwd=HERE)
    if rc != 0:
        return rc
    if not peers and os.environ.get("SPECDEC_BENCH_E2E", "1") == "1":  # the end-to-end `specdec compare` table
        rc = _call([sys.executable, os.path.join(HERE, "decoders", "record_compare.py")])
        if rc != 0:
            return rc
    return _call([sys.executable, os.path.join(HERE, "make_results.py")])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
