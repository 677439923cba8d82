"""Helpers of the `specdec sample` tests: the command on the tiny random family, in process, and
the files it writes."""
import os

from specdec import cli


def sample(out, *extra, method="ar", num=5):
    return cli.main(["sample", "--method", method, "--num", str(num), "--out", str(out), "--quiet",
                     "--device", "cpu", *map(str, extra)])


def files(out):
    """Every image file and the npz of a sample directory, by relative path."""
    got = {}
    for folder, _, names in os.walk(out):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), out)
            if rel.startswith("images") or rel == "samples.npz":
                got[rel] = open(os.path.join(folder, name), "rb").read()
    return got
