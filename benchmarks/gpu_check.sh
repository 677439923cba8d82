#!/usr/bin/env bash
# One-shot validation on a fresh GPU machine that already has torch, triton, pytest,
# pytest-benchmark and hypothesis (no network needed):
#
#   benchmarks/gpu_check.sh OUTDIR            # build, test on CUDA tensors, benchmark, summarise
#   benchmarks/gpu_check.sh OUTDIR --dry-run  # check that every step and file exists; run nothing
#
# Steps: (1) build specdec._C for this GPU's architecture, (2) the whole test suite on CUDA
# tensors (Triton compiled for real, no interpreter), (3) copy bandwidth and bf16 matrix rate,
# (4) the benchmarks, (5) OUTDIR/summary.md. Logs and JSON go to OUTDIR (six files, so they fit
# the device tool's limits). Budget: about 8 minutes on an H100/H200; each step has a timeout.
set -uo pipefail

OUT="${1:?usage: benchmarks/gpu_check.sh OUTDIR [--dry-run]}"
DRY=0
[[ "${2:-}" == "--dry-run" ]] && DRY=1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT"
mkdir -p "$OUT"

STEPS=(
  "build|240|env SPECDEC_NO_EXT=1 $PY -m pip install -q --no-build-isolation --no-deps --no-index -e . && env MAX_JOBS=\${MAX_JOBS:-16} $PY setup.py -q build_ext --inplace && $PY -c 'import specdec, json; print(json.dumps(specdec.build_info()))'"
  "tests|300|$PY -m pytest -q -x -p no:cacheprovider tests --junitxml=$OUT/junit.xml"
  "limits|60|$PY benchmarks/device_limits.py $OUT/limits.json"
  "bench|180|env SPECDEC_BENCH_E2E=0 $PY benchmarks/run.py"
)
REQUIRED_FILES=(setup.py pyproject.toml tests/conftest.py benchmarks/run.py benchmarks/make_results.py
                benchmarks/device_limits.py benchmarks/conftest.py)

if [[ $DRY == 1 ]]; then
  status=0
  command -v "$PY" >/dev/null || { echo "missing: $PY"; status=1; }
  for f in "${REQUIRED_FILES[@]}"; do [[ -f "$f" ]] || { echo "missing file: $f"; status=1; }; done
  ls benchmarks/bench_*.py >/dev/null 2>&1 || { echo "no benchmarks/bench_*.py"; status=1; }
  for mod in torch pytest pytest_benchmark hypothesis; do
    "$PY" -c "import $mod" 2>/dev/null || { echo "python module missing: $mod"; status=1; }
  done
  for py in benchmarks/run.py benchmarks/make_results.py benchmarks/device_limits.py; do
    "$PY" -m py_compile "$py" || status=1
  done
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<<"$step"
    echo "[dry-run] $name (timeout ${limit}s): $cmd"
    bash -n -c "$cmd" || { echo "step $name does not parse"; status=1; }
  done
  [[ $status == 0 ]] && echo "dry run OK: every step parses and every file it calls exists"
  exit $status
fi

# The target architecture of this GPU only: a faster build than the sm_80 + sm_90a default.
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  cap=$("$PY" -c 'import torch; p = torch.cuda.get_device_capability(); print(f"{p[0]}.{p[1]}" + ("a" if p[0] == 9 else ""))')
  export TORCH_CUDA_ARCH_LIST="$cap"
fi
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

declare -A RESULT SECONDS_TAKEN
for step in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$step"
  echo "== $name (timeout ${limit}s)"
  start=$(date +%s)
  timeout "$limit" bash -c "$cmd" >"$OUT/$name.log" 2>&1
  rc=$?
  SECONDS_TAKEN[$name]=$(( $(date +%s) - start ))
  RESULT[$name]=$([[ $rc == 0 ]] && echo ok || echo "FAILED (exit $rc)")
  tail -n 3 "$OUT/$name.log"
  if [[ $name == build && $rc != 0 ]]; then
    echo "build failed; see $OUT/build.log"
    break
  fi
done
latest=$(ls -t benchmarks/results/*.json 2>/dev/null | head -1)
[[ -n "$latest" ]] && cp "$latest" "$OUT/bench.json"

{
  echo "# specdec GPU check — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  "$PY" -c 'import torch; print("Device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)' 2>/dev/null
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---|"
  for step in "${STEPS[@]}"; do
    name=${step%%|*}
    echo "| $name | ${RESULT[$name]:-not run} | ${SECONDS_TAKEN[$name]:-} |"
  done
  echo
  grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -n 1
  echo
  [[ -f "$OUT/limits.json" ]] && { echo '```'; cat "$OUT/limits.json"; echo '```'; }
  echo
  [[ -f benchmarks/RESULTS.md ]] && sed -n '/^## /,/^## /p' benchmarks/RESULTS.md | head -n 80
} >"$OUT/summary.md"
cat "$OUT/summary.md"
[[ "${RESULT[build]}" == ok && "${RESULT[tests]:-}" == ok ]]
