"""The one reader of the kernels' machine code without a GPU: cuobjdump -res-usage (registers,
stack, shared and local memory per function) and -sass (which instructions), for the extension and
for Triton programs lowered to sm_90a (`lower_triton`, in a subprocess: the test suite runs under
TRITON_INTERPRET=1, where lowering is impossible). tests/kernels/test_build.py and
tests/kernels/test_pool_gpu_machine_code.py assert on these; run as a script it writes the two
tables benchmarks/results/res-usage-attention.md and res-usage-pooling.md:

    python benchmarks/machine/machine_code.py [attention|pooling|all]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TENSOR_CORE_OPS = ("HMMA", "HGMMA")
LDG_128 = re.compile(r"\bLDG\.E(?:\.[A-Z0-9_]+)*\.128\b")


# ---- the tools ------------------------------------------------------------------------------

def tool(name: str):
    """Path of a CUDA binary tool (cuobjdump, nvdisasm) from PATH, the nvidia-cuda-* wheels or
    Triton's copy, or None."""
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    for cand in (shutil.which(name), *glob.glob(os.path.join(site, "nvidia", "*", "bin", name)),
                 *glob.glob(os.path.join(site, "triton", "backends", "nvidia", "bin", name))):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def cuobjdump():
    """Path of cuobjdump, or None."""
    return tool("cuobjdump")


def sass_available() -> bool:
    return cuobjdump() is not None and tool("nvdisasm") is not None


def _run(args) -> str:
    found = cuobjdump()
    if found is None:
        raise FileNotFoundError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    env = dict(os.environ)
    nvdisasm = tool("nvdisasm")   # -sass runs nvdisasm, which it looks up on PATH
    env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(nvdisasm) if nvdisasm else "", os.path.dirname(found),
                                              env.get("PATH", "")) if p)
    proc = subprocess.run([found, *args], capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def _arch(arch):
    return ["-arch", arch] if arch else []


def res_usage(path: str, arch: str = None) -> list:
    """One dict per (arch, function): arch, function (mangled), REG, STACK, SHARED, LOCAL."""
    rows, current = [], None
    lines = _run(["-res-usage", *_arch(arch), path]).splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            current = m.group(1)
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m and i + 1 < len(lines):
            fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", lines[i + 1]))
            rows.append({"arch": current, "function": m.group(1),
                         **{k: int(fields.get(k, 0)) for k in ("REG", "STACK", "SHARED", "LOCAL")}})
    return rows


def usage_by_function(path: str, arch: str = None) -> dict:
    """{mangled function: {"REG", "STACK", "SHARED", "LOCAL"}} of one architecture's code."""
    return {r["function"]: {k: r[k] for k in ("REG", "STACK", "SHARED", "LOCAL")} for r in res_usage(path, arch)}


def sass_functions(path: str, arch: str = None) -> dict:
    """{mangled function: its SASS text} (needs nvdisasm)."""
    funcs, name, body = {}, None, []
    for line in _run(["-sass", *_arch(arch), path]).splitlines():
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


def sass_opcodes(path: str, opcodes=TENSOR_CORE_OPS) -> dict:
    """{(arch, function): {opcode: count}} over the SASS of every function in `path`."""
    counts, arch, fn = {}, None, None
    pattern = re.compile(r"\b(" + "|".join(opcodes) + r")\b")
    for line in _run(["-sass", path]).splitlines():
        m = re.match(r"\s*code for (sm_\w+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            fn = m.group(1)
            counts[(arch, fn)] = {op: 0 for op in opcodes}
            continue
        if fn is not None:
            for op in pattern.findall(line):
                counts[(arch, fn)][op] += 1
    return counts


def spills(usage: dict) -> bool:
    """A stack frame or local memory: registers spilled."""
    return usage.get("STACK", 0) > 0 or usage.get("LOCAL", 0) > 0


def demangle(names):
    if shutil.which("c++filt") is None:
        return list(names)
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=60)
    return proc.stdout.splitlines() if proc.returncode == 0 else list(names)


# ---- Triton programs lowered for sm_90a -----------------------------------------------------

_LOWER = r"""
import importlib, json, sys
try:
    import triton
    from triton.backends.compiler import GPUTarget
    import triton.backends.nvidia  # noqa: F401
except Exception as exc:  # no Triton GPU backend here
    print(json.dumps({"skip": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
workdir, module, names = sys.argv[1], sys.argv[2], [n for n in sys.argv[3].split(",") if n]
mod = importlib.import_module("specdec.triton_kernels." + module)
rows = []
for i, spec in enumerate(getattr(mod, "LOWERING_SPECS", [])):
    fn, signature, constexprs = spec[:3]
    if names and fn.__name__ not in names:
        continue
    options = spec[3] if len(spec) > 3 else {}
    # spec[4]: arguments a typical launch specialises as multiples of 16 (aligned tensors, V % 16 == 0)
    aligned = spec[4] if len(spec) > 4 else ()
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    ptx = k.asm["ptx"]
    cubin = f"{workdir}/{module}-{i}.cubin"
    with open(cubin, "wb") as f:
        f.write(k.asm["cubin"])
    rows.append({"kernel": fn.__name__, "cubin": cubin, "cubin_bytes": len(k.asm["cubin"]),
                 "sm_90a": ".target sm_90a" in ptx, "mma": ("mma" in ptx) or ("wgmma" in ptx),
                 "aligned": bool(aligned), "shared": k.metadata.shared, "signature": signature,
                 "dtype": signature.get("logits_ptr", signature.get("p_ptr", signature.get("q_ptr"))),
                 "config": {a: b for a, b in constexprs.items() if a.isupper()} | options,
                 # Attention programs: 16-bit dots must reach the tensor cores, float32 ones must not.
                 "expect_tensor_cores": None if "DOT_FP32" not in constexprs else not constexprs["DOT_FP32"]})
print(json.dumps({"rows": rows}))
"""


def lower_triton(module: str, workdir: str, names=()) -> dict:
    """Lower the LOWERING_SPECS of specdec.triton_kernels.<module> (those of the kernels `names`, or
    all) for sm_90a into cubins in `workdir`: {"rows": [...]} (kernel, cubin, config, ...), or
    {"skip": why} where Triton has no NVIDIA backend."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)   # lowering needs the compiler, not the interpreter
    proc = subprocess.run([sys.executable, "-c", _LOWER, workdir, module, ",".join(sorted(names))],
                          capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the pooling kernels --------------------------------------------------------------------

#: CUDA kernels of the pooling ops: name -> (op, path); SPECDEC_CUDA_POOL picks the path.
CUDA_POOLING = {
    "pool_probs_kernel": ("pool_probs", "default (streamed)"),
    "pool_probs_smem_kernel": ("pool_probs", "v2 (shared memory, SPECDEC_CUDA_POOL=v2)"),
    "pool_probs_radix_kernel": ("pool_probs", "radix (SPECDEC_CUDA_POOL=radix)"),
    "sampling_probs_kernel": ("sampling_probs", "default (streamed)"),
    "sampling_probs_smem_kernel": ("sampling_probs", "v2 (shared memory, SPECDEC_CUDA_POOL=v2)"),
    "sampling_probs_radix_kernel": ("sampling_probs", "radix (SPECDEC_CUDA_POOL=radix)"),
    "sample_residual_kernel": ("sample_residual", "default (streamed)"),
    "sample_residual_smem_kernel": ("sample_residual", "v2 and radix (shared memory)"),
}
#: Triton kernels of the pooling ops (the onchip ones: SPECDEC_TRITON_POOL=onchip).
TRITON_POOLING = {"_pool_probs_kernel", "_sampling_probs_kernel", "_sample_residual_kernel",
                  "_pool_probs_onchip_kernel", "_sampling_probs_onchip_kernel", "_sample_residual_onchip_kernel"}


def cuda_kernel_key(mangled: str):
    """The CUDA_POOLING key of a mangled kernel name, or None (Itanium names embed `<len><name>`)."""
    for key in CUDA_POOLING:
        if f"{len(key)}{key}" in mangled:
            return key
    return None


def cuda_rows(so_path: str, arch: str = "sm_90a") -> list:
    """One row per instantiation of a pooling CUDA kernel in the extension."""
    usage, sass = usage_by_function(so_path, arch), sass_functions(so_path, arch)
    rows = []
    for name, u in sorted(usage.items()):
        key = cuda_kernel_key(name)
        if key is not None:
            op, path = CUDA_POOLING[key]
            rows.append({"backend": "cuda", "kernel": key, "op": op, "path": path, "symbol": name,
                         "ldg128": len(LDG_128.findall(sass.get(name, ""))), **u})
    return rows


def triton_rows(workdir: str) -> list:
    """One row per lowering spec of a Triton pooling kernel."""
    rows = []
    for module in ("pooling", "verification"):
        lowered = lower_triton(module, workdir, TRITON_POOLING)
        for r in lowered.get("rows", []):
            (u,) = usage_by_function(r["cubin"]).values()
            (text,) = sass_functions(r["cubin"]).values()
            rows.append({"backend": "triton", "op": r["kernel"].strip("_").replace("_kernel", ""),
                         "ldg128": len(LDG_128.findall(text)), **r, **u})
    return rows


_DTYPES = {"N3c104HalfE": "fp16", "N3c108BFloat16E": "bf16", "f": "fp32", "d": "fp64"}


def _instantiation(symbol: str):
    """(logits dtype, neighbour table dtype) from a kernel's mangled template arguments."""
    m = re.search(r"I(N3c104HalfE|N3c108BFloat16E|f|d)([is]?)", symbol)
    return (_DTYPES[m.group(1)], {"i": "int32", "s": "int16", "": ""}[m.group(2)]) if m else ("fp32", "")


def pooling_report(cuda: list, triton: list) -> str:
    lines = ["# Resource usage of the pooling kernels (sm_90a, `cuobjdump -res-usage` / `-sass`)", "",
             "Compiled without a GPU (nvcc 13.0 for the extension, Triton lowered with "
             "`GPUTarget(\"cuda\", 90, 32)`); regenerate with `python benchmarks/machine/machine_code.py pooling`. "
             "LDG.E.128 = 128-bit global loads in the SASS; spills = STACK or LOCAL bytes > 0. The CUDA v2 and "
             "radix kernels (`SPECDEC_CUDA_POOL`) and the Triton onchip kernels (`SPECDEC_TRITON_POOL=onchip`) "
             "are opt-in and have never run on a GPU.", "",
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
        inst = logits + (f", neighbours {'/'.join(sorted(set(t for t in tables if t)))}" if any(tables) else "")
        lines.append(f"| {op} | {kernel} | {path} | {inst} | {reg} | {shared} | {stack} | {local} | {ldg} |")
    lines += ["", "## Triton (specdec.triton_kernels)", "",
              "| op | config | registers | shared (B) | stack (B) | local (B) | LDG.E.128 |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in triton:
        c = r["config"]
        flags = [k for k in ("HAS_UNCOND", "HAS_Q", "HAS_U", "USE_TOP_K", "USE_TOP_P", "SINGLE_TILE") if c.get(k)]
        config = ", ".join([f"{(r['dtype'] or '').lstrip('*')}"] + flags +
                           [f"{k}={c[k]}" for k in ("BLOCK_V", "num_warps", "maxnreg") if k in c] +
                           ["aligned" if r["aligned"] else "unaligned"])
        lines.append(f"| {r['op']} | {config} | {r.get('REG')} | {r.get('SHARED')} | {r.get('STACK')} | "
                     f"{r.get('LOCAL')} | {r['ldg128']} |")
    return "\n".join(lines) + "\n"


# ---- the attention kernels ------------------------------------------------------------------

_SPLIT = re.compile(r"split_attention_kernel<(float|c10::Half|c10::BFloat16), (\d+), (\d+)>")


def cuda_attention_kernel(demangled: str):
    """(kernel, dtype, head dim padded, warps along M) of an attention function of the extension,
    or None for other kernels."""
    m = _SPLIT.search(demangled)
    if m:
        return "split_attention_kernel", m.group(1).replace("c10::", "").lower(), int(m.group(2)), int(m.group(3))
    for name in ("merge_splits_kernel", "tree_attention_kernel"):
        if name + "<" in demangled:
            dtype = re.search(name + r"<([^>]+)>", demangled).group(1).replace("c10::", "").lower()
            return name, dtype, None, None
    return None


def attention_report() -> str:
    """The markdown table of every attention kernel's resources, CUDA then Triton."""
    import specdec
    from specdec.ops import dispatch

    lines = ["# Attention kernels: registers, shared memory, spills (cuobjdump -res-usage)", "",
             "Generated by `benchmarks/machine/machine_code.py attention` on a machine without a GPU: nvcc 13.0 for "
             "the extension (TORCH_CUDA_ARCH_LIST " + ";".join(specdec.build_info().get("cuda_archs") or ["n/a"]) +
             "), Triton lowered with `GPUTarget(\"cuda\", 90, 32)` (sm_90a). STACK and LOCAL are bytes per thread "
             "(spills land there); SHARED is static shared memory, `dyn smem` the dynamic shared memory a launch "
             "asks for; `TC ops` counts HMMA / HGMMA instructions in the SASS.", "",
             "Never run on a GPU: every `split_attention_kernel` and `merge_splits_kernel` (CUDA), "
             "`_split_kv_kernel` and `_merge_splits_kernel` (Triton): the opt-in paths "
             "(SPECDEC_ATTN_PATH=decode|prefill|auto). `tree_attention_kernel` (CUDA) and "
             "`_tree_attention_kernel` (Triton) are the defaults timed on the H200 on 2026-11-30 (their tile "
             "configs of that day; the register-fit Triton configs chosen afterwards have not been timed either).", "",
             "Checked by tests/kernels/test_build.py: the new kernels have no stack frame and no local memory on any "
             "architecture; every 16-bit program issues HMMA or HGMMA, no float32 program does (the contract's IEEE "
             "dots). The 8-byte frames of the default kernels (CUDA float32 on sm_80, two Triton tree-mask configs) "
             "are older than the split kernels and are tolerated as a few words.", ""]
    if dispatch.has_cuda_kernels():
        so = dispatch.extension().__file__
        usage = res_usage(so)
        sass = sass_opcodes(so) if sass_available() else {}
        names = demangle([r["function"] for r in usage])
        smem = {(c[0], c[1], c[2]): (c[3], c[4]) for c in dispatch.extension().split_attention_configs()}
        lines += ["## CUDA (specdec._C)", "",
                  "| arch | kernel | dtype | D padded | block | REG | STACK | LOCAL | SHARED | dyn smem | keys/step | "
                  "TC ops |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r, name in sorted(zip(usage, names), key=lambda x: (x[0]["arch"], x[1])):
            kind = cuda_attention_kernel(name)
            if kind is None:
                continue
            kernel, dtype, dp, wm = kind
            block = "" if wm is None else ("decode: 16 rows, 4 warps on keys" if wm == 1
                                           else "prefill: 64 rows, 4 warps on rows")
            dyn, keys = smem.get((dtype, dp, wm), ("", "")) if dp else ("", "")
            tc = sass.get((r["arch"], r["function"]), {})
            lines.append(f"| {r['arch']} | {kernel} | {dtype} | {dp or ''} | {block} | {r['REG']} | {r['STACK']} | "
                         f"{r['LOCAL']} | {r['SHARED']} | {dyn} | {keys} | "
                         f"{' / '.join(str(tc.get(op, 0)) for op in TENSOR_CORE_OPS) if tc else 'n/a'} |")
        lines.append("")
    else:
        lines += ["(specdec._C was built without CUDA kernels: no CUDA table.)", ""]
    lines += ["## Triton (triton_kernels/attention.py LOWERING_SPECS, sm_90a)", "",
              "| kernel | dtype | config | REG | STACK | LOCAL | SHARED (Triton) | TC ops |",
              "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for r in lower_triton("attention", tmp).get("rows", []):
            u = res_usage(r["cubin"])[0]
            tc = next(iter(sass_opcodes(r["cubin"]).values())) if sass_available() else {}
            dtype = r["signature"].get("q_ptr", r["signature"].get("out_ptr", "")).lstrip("*")
            config = ", ".join(f"{k}={v}" for k, v in r["config"].items())
            ops = " / ".join(str(tc.get(op, 0)) for op in TENSOR_CORE_OPS) if tc else "n/a"
            lines.append(f"| {r['kernel']} | {dtype} | {config} | {u['REG']} | {u['STACK']} | {u['LOCAL']} | "
                         f"{r['shared']} | {ops} |")
    return "\n".join(lines) + "\n"


REPORTS = ("attention", "pooling", "all")


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the kernels' machine-code tables: "
                                                 "benchmarks/results/res-usage-<which>.md (cuobjdump, no GPU).")
    parser.add_argument("which", nargs="?", choices=REPORTS, default="all", help="the table to write (default: all)")
    which = parser.parse_args(argv).which
    sys.path.insert(0, ROOT)
    import specdec

    if cuobjdump() is None or tool("nvdisasm") is None:
        sys.exit("needs cuobjdump and nvdisasm: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    os.makedirs(RESULTS, exist_ok=True)
    if which in ("attention", "all"):
        with open(os.path.join(RESULTS, "res-usage-attention.md"), "w") as f:
            f.write(attention_report())
    if which in ("pooling", "all"):
        cuda = cuda_rows(specdec.ops.dispatch.extension().__file__) if specdec.build_info()["cuda_kernels"] else []
        with tempfile.TemporaryDirectory() as tmp:
            text = pooling_report(cuda, triton_rows(tmp))
        with open(os.path.join(RESULTS, "res-usage-pooling.md"), "w") as f:
            f.write(text)
    print(f"wrote {RESULTS}/res-usage-{which}.md" if which != "all" else f"wrote {RESULTS}/res-usage-*.md")


if __name__ == "__main__":
    main()
