"""Machine-code evidence for the pooling kernels without a GPU (issue #19, item 5).

Reads the sm_90a SASS and the resource usage (`cuobjdump -sass`, `-res-usage`) of
- the CUDA kernels of the built extension (specdec._C), and
- the Triton kernels of specdec.triton_kernels.{pooling,verification} lowered for sm_90a,
and reports, per kernel, whether it issues 128-bit global loads (LDG.E.128), whether it spills
(a stack frame or local memory), and its registers and static shared memory.
tests/test_build.py asserts on the same facts; run this file to write the markdown table:

    python benchmarks/sass_report.py            # -> benchmarks/results/res-usage-pooling.md
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_code import tool  # noqa: E402  (the one lookup of cuobjdump / nvdisasm)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "benchmarks", "results", "res-usage-pooling.md")

#: CUDA kernels of the pooling ops: name fragment -> (op, path, runs by default)
CUDA_POOLING = {
    "pool_probs_kernel": ("pool_probs", "v1 (streamed, default)"),
    "pool_probs_smem_kernel": ("pool_probs", "v2 (shared memory, SPECDEC_CUDA_POOL_V2=1)"),
    "sampling_probs_kernel": ("sampling_probs", "v1 (streamed, default)"),
    "sampling_probs_smem_kernel": ("sampling_probs", "v2 (shared memory, SPECDEC_CUDA_POOL_V2=1)"),
    "sample_residual_kernel": ("sample_residual", "v1 (streamed, default)"),
    "sample_residual_smem_kernel": ("sample_residual", "v2 (shared memory, SPECDEC_CUDA_POOL_V2=1)"),
}
TRITON_POOLING = {"_pool_probs_kernel", "_sampling_probs_kernel", "_sample_residual_kernel"}
LDG_128 = re.compile(r"\bLDG\.E(?:\.[A-Z0-9_]+)*\.128\b")


def _tool_env():
    # cuobjdump -sass runs nvdisasm, which it looks up on PATH.
    env = dict(os.environ)
    nvdisasm = tool("nvdisasm")
    if nvdisasm:
        env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    return env


def res_usage(path: str, arch: str = None) -> dict:
    """{mangled function name: {"REG": int, "STACK": int, "SHARED": int, "LOCAL": int}}."""
    cmd = [tool("cuobjdump"), "-res-usage"] + (["-arch", arch] if arch else []) + [path]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_tool_env()).stdout
    usage, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function ([^:\s]+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            usage[name] = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            name = None
    return usage


def sass_functions(path: str, arch: str = None) -> dict:
    """{mangled function name: its SASS text} (needs nvdisasm)."""
    cmd = [tool("cuobjdump"), "-sass"] + (["-arch", arch] if arch else []) + [path]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_tool_env()).stdout
    funcs, name, body = {}, None, []
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                funcs[name] = "\n".join(body)
            name, body = m.group(1), []
        elif name:
            body.append(line)
    if name:
        funcs[name] = "\n".join(body)
    return funcs


def cuda_kernel_key(mangled: str):
    """The CUDA_POOLING key of a mangled kernel name, or None (Itanium names embed `<len><name>`)."""
    for key in CUDA_POOLING:
        if f"{len(key)}{key}" in mangled:
            return key
    return None


def cuda_rows(so_path: str, arch: str = "sm_90a") -> list:
    """One row per instantiation of a pooling CUDA kernel in the extension."""
    usage = res_usage(so_path, arch)
    sass = sass_functions(so_path, arch)
    rows = []
    for name, u in sorted(usage.items()):
        key = cuda_kernel_key(name)
        if key is None:
            continue
        op, path = CUDA_POOLING[key]
        text = sass.get(name, "")
        rows.append({"backend": "cuda", "kernel": key, "op": op, "path": path, "symbol": name,
                     "ldg128": len(LDG_128.findall(text)), **u})
    return rows


_LOWER = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
mod = importlib.import_module("specdec.triton_kernels." + sys.argv[1])
rows = []
for i, spec in enumerate(getattr(mod, "LOWERING_SPECS", [])):
    fn, signature, constexprs = spec[:3]
    if fn.__name__ not in sys.argv[3].split(","):
        continue
    options = spec[3] if len(spec) > 3 else {}
    aligned = spec[4] if len(spec) > 4 else ()
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    cubin = f"{sys.argv[2]}/{sys.argv[1]}-{i}.cubin"
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    rows.append({"kernel": fn.__name__, "cubin": cubin, "aligned": bool(aligned),
                 "dtype": signature.get("logits_ptr", signature.get("p_ptr")),
                 "config": {a: b for a, b in constexprs.items() if a.isupper()} | options})
print(json.dumps(rows))
"""


def triton_rows(workdir: str) -> list:
    """One row per lowering spec of a Triton pooling kernel (lowered in a subprocess: the test
    suite runs under TRITON_INTERPRET=1, where lowering is impossible)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    rows = []
    for module in ("pooling", "verification"):
        proc = subprocess.run([sys.executable, "-c", _LOWER, module, workdir, ",".join(sorted(TRITON_POOLING))],
                              capture_output=True, text=True, env=env, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        for r in json.loads(proc.stdout.strip().splitlines()[-1]):
            (u,) = res_usage(r["cubin"]).values()
            (text,) = sass_functions(r["cubin"]).values()
            rows.append({"backend": "triton", "op": r["kernel"].strip("_").replace("_kernel", ""),
                         "ldg128": len(LDG_128.findall(text)), **r, **u})
    return rows


def spills(row: dict) -> bool:
    return row.get("STACK", 0) > 0 or row.get("LOCAL", 0) > 0


def _config(row):
    c = row["config"]
    flags = [k for k in ("HAS_UNCOND", "HAS_Q", "HAS_U", "USE_TOP_K", "USE_TOP_P", "SINGLE_TILE") if c.get(k)]
    return ", ".join([f"{row['dtype'].lstrip('*')}"] + flags + [f"BLOCK_V={c['BLOCK_V']}", f"warps={c['num_warps']}",
                                                            "aligned" if row["aligned"] else "unaligned"])


_DTYPES = {"N3c104HalfE": "fp16", "N3c108BFloat16E": "bf16", "f": "fp32", "d": "fp64"}
_TABLES = {"i": "int32", "s": "int16", "": ""}


def _instantiation(symbol: str):
    """(logits dtype, neighbour table dtype) from a kernel's mangled template arguments."""
    m = re.search(r"I(N3c104HalfE|N3c108BFloat16E|f|d)([is]?)EEv", symbol)
    return (_DTYPES[m.group(1)], _TABLES[m.group(2)]) if m else ("fp32", "")


def markdown(cuda: list, triton: list) -> str:
    lines = ["# Resource usage of the pooling kernels (sm_90a, `cuobjdump -res-usage` / `-sass`)", "",
             "Compiled without a GPU (nvcc 13.0 for the extension, Triton lowered with "
             "`GPUTarget(\"cuda\", 90, 32)`); regenerate with `python benchmarks/sass_report.py`. "
             "LDG.E.128 = 128-bit global loads in the SASS; spills = STACK or LOCAL bytes > 0. "
             "The CUDA v2 kernels are opt-in (`SPECDEC_CUDA_POOL_V2=1`) and have never run on a GPU.", "",
             "## CUDA (specdec._C)", "",
             "| op | kernel | path | logits | registers | static shared (B) | stack (B) | local (B) | LDG.E.128 |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    merged = {}  # instantiations that differ only in the neighbour table's dtype share a row
    for r in cuda:
        logits, table = _instantiation(r["symbol"])
        if logits == "fp64":
            continue  # instantiated by AT_DISPATCH, refused by the argument checks: never launched
        key = (r["op"], r["kernel"], r["path"], logits, r.get("REG"), r.get("SHARED"), r.get("STACK"),
               r.get("LOCAL"), r["ldg128"])
        merged.setdefault(key, []).append(table)
    for (op, kernel, path, logits, reg, shared, stack, local, ldg), tables in merged.items():
        inst = logits + (f", neighbours {'/'.join(t for t in tables if t)}" if any(tables) else "")
        lines.append(f"| {op} | {kernel} | {path} | {inst} | {reg} | {shared} | {stack} | {local} | {ldg} |")
    lines += ["", "Dynamic shared memory of the v2 kernels: V x 4 bytes per block (64 KiB at V = 16384), "
              "within the opt-in limit (227 KiB on H100/H200, 163 KiB on A100); larger rows use v1.", "",
              "## Triton (specdec.triton_kernels)", "",
              "| op | config | registers | shared (B) | stack (B) | local (B) | LDG.E.128 |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in triton:
        lines.append(f"| {r['op']} | {_config(r)} | {r.get('REG')} | {r.get('SHARED')} | {r.get('STACK')} | "
                     f"{r.get('LOCAL')} | {r['ldg128']} |")
    return "\n".join(lines) + "\n"


def main():
    sys.path.insert(0, ROOT)
    import specdec

    if tool("cuobjdump") is None or tool("nvdisasm") is None:
        sys.exit("needs cuobjdump and nvdisasm: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    cuda = []
    if specdec.build_info()["cuda_kernels"]:
        cuda = cuda_rows(specdec.ops.dispatch.extension().__file__)
    with tempfile.TemporaryDirectory() as tmp:
        triton = triton_rows(tmp)
    os.makedirs(os.path.dirname(TABLE), exist_ok=True)
    with open(TABLE, "w") as f:
        f.write(markdown(cuda, triton))
    print(f"wrote {TABLE}")


if __name__ == "__main__":
    main()
