"""Reading the kernels' machine code without a GPU: cuobjdump -res-usage (registers, stack,
shared and local memory per function) and -sass (which instructions), for the extension and for
Triton programs lowered to sm_90a. tests/test_build.py asserts on these; run as a script it
writes benchmarks/results/res-usage-attention.md:

    .venv/bin/python benchmarks/machine_code.py [OUT.md]
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSOR_CORE_OPS = ("HMMA", "HGMMA")


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


def _run(args):
    tool = cuobjdump()
    if tool is None:
        raise FileNotFoundError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    env = dict(os.environ)
    # -sass runs nvdisasm, which the wheels put beside cuobjdump.
    env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run([tool, *args], capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def sass_available() -> bool:
    tool = cuobjdump()
    return tool is not None and (shutil.which("nvdisasm") is not None
                                 or os.path.exists(os.path.join(os.path.dirname(tool), "nvdisasm")))


def res_usage(path: str) -> list:
    """One dict per (arch, function): arch, function (mangled), REG, STACK, SHARED, LOCAL."""
    rows, arch = [], None
    lines = _run(["-res-usage", path]).splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            arch = m.group(1)
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m and i + 1 < len(lines):
            fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", lines[i + 1]))
            rows.append({"arch": arch, "function": m.group(1),
                         **{k: int(fields.get(k, 0)) for k in ("REG", "STACK", "SHARED", "LOCAL")}})
    return rows


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


def demangle(names):
    if shutil.which("c++filt") is None:
        return list(names)
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=60)
    return proc.stdout.splitlines() if proc.returncode == 0 else list(names)


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


def _lower_triton(specs, workdir):
    import triton
    from triton.backends.compiler import GPUTarget

    out = []
    for i, (fn, signature, constexprs, *rest) in enumerate(specs):
        options = rest[0] if rest else {}
        k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32), options=options)
        cubin = os.path.join(workdir, f"{i}.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        out.append((fn.__name__, signature, constexprs, options, cubin, k.metadata.shared))
    return out


def report() -> str:
    """The markdown table of every attention kernel's resources, CUDA then Triton."""
    import specdec
    from specdec.ops import dispatch as _extension

    lines = ["# Attention kernels: registers, shared memory, spills (cuobjdump -res-usage)", "",
             "Generated by `benchmarks/machine_code.py` on a machine without a GPU: nvcc 13.0 for the",
             "extension (TORCH_CUDA_ARCH_LIST " + ";".join(specdec.build_info().get("cuda_archs") or ["n/a"]) + "), Triton "
             "lowered with `GPUTarget(\"cuda\", 90, 32)` (sm_90a). STACK and LOCAL are bytes per thread "
             "(spills land there); SHARED is static shared memory (1024 for every kernel on sm_90a, "
             "kernels that declare none included), `dyn smem` the dynamic shared memory a launch asks "
             "for; `TC ops` counts HMMA / HGMMA instructions in the SASS.", "",
             "Never run on a GPU: every `split_attention_kernel` and `merge_splits_kernel` (CUDA), "
             "`_split_kv_kernel` and `_merge_splits_kernel` (Triton): the opt-in paths "
             "(SPECDEC_ATTN_PATH=decode|prefill|auto). `tree_attention_kernel` (CUDA) and "
             "`_tree_attention_kernel` (Triton) are the defaults timed on the H200 on 2026-11-30 (their "
             "tile configs of that day; the register-fit Triton configs chosen afterwards have not been "
             "timed either).", "",
             "Checked by tests/test_build.py: the new kernels have no stack frame and no local memory on "
             "any architecture; every 16-bit program issues HMMA or HGMMA, no float32 program does (the "
             "contract's IEEE dots). The 8-byte frames of the default kernels (CUDA float32 on sm_80, two "
             "Triton tree-mask configs) predate issue #19 and are tolerated as a few words.", ""]
    if _extension.has_cuda_kernels():
        so = _extension.extension().__file__
        usage = res_usage(so)
        sass = sass_opcodes(so) if sass_available() else {}
        names = demangle([r["function"] for r in usage])
        smem = {(c[0], c[1], c[2]): (c[3], c[4]) for c in _extension.extension().split_attention_configs()}
        lines += ["## CUDA (specdec._C)", "",
                  "| arch | kernel | dtype | D padded | block | REG | STACK | LOCAL | SHARED | dyn smem | keys/step | TC ops |",
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
    from specdec.triton_kernels import attention

    lines += ["## Triton (triton_kernels/attention.py LOWERING_SPECS, sm_90a)", "",
              "| kernel | dtype | config | REG | STACK | LOCAL | SHARED (Triton) | TC ops |",
              "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, signature, constexprs, options, cubin, shared in _lower_triton(attention.LOWERING_SPECS, tmp):
            r = res_usage(cubin)[0]
            tc = next(iter(sass_opcodes(cubin).values())) if sass_available() else {}
            dtype = signature.get("q_ptr", signature.get("out_ptr", "")).lstrip("*")
            config = ", ".join(f"{k}={v}" for k, v in {**constexprs, **options}.items())
            lines.append(f"| {name} | {dtype} | {config} | {r['REG']} | {r['STACK']} | {r['LOCAL']} | {shared} | "
                         f"{' / '.join(str(tc.get(op, 0)) for op in TENSOR_CORE_OPS) if tc else 'n/a'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # lowering needs the compiler, not the interpreter
    sys.path.insert(0, ROOT)
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "benchmarks", "results", "res-usage-attention.md")
    text = report()
    with open(target, "w") as f:
        f.write(text)
    print(text)
