#!/usr/bin/env bash
# One-shot validation on a fresh GPU machine that already has torch, triton, pytest,
# pytest-benchmark and hypothesis (no network needed):
#
#   benchmarks/gpu_check.sh OUTDIR            # build, test on CUDA tensors, benchmark, summarise
#   benchmarks/gpu_check.sh OUTDIR --dry-run  # check that every step and file exists; run nothing
#   GPU_CHECK_STEPS="build tests" benchmarks/gpu_check.sh OUTDIR   # a subset of the steps
#   GPU_CHECK_STEPS=pool benchmarks/gpu_check.sh OUTDIR   # the pooling check (below)
#   GPU_CHECK_STEPS="build continuous" benchmarks/gpu_check.sh OUTDIR   # continuous batching, CUDA graphs
#
# Steps, the ones never run on a GPU first: (1) build specdec._C for this GPU's architecture (the
# CUDA kernels required: SPECDEC_CUDA=1), (2) exact mode's race kernels on CUDA and Triton (bit for
# bit and the chi-square test), (3) the tests that run on CUDA tensors or compile Triton for real
# (tests/kernels and the decoders' CUDA tests; the whole suite runs in CI on CPUs), (4) the decode
# engine's tables (benchmarks/decoders/record_engine.py: every method eager at batch 1 and 16, then
# ar, mulo and ssd compiled with CUDA graphs; two runs with a timeout each, so a slow first compile
# cannot cost the eager table, and a run stopped by its timeout still saves what it measured), (5)
# the opt-in attention paths (SPECDEC_ATTN_PATH=decode|prefill|auto), (6) copy bandwidth and bf16
# matrix rate, (7) the kernel benchmarks, (8) `specdec compare` of every method on CUDA (measured
# on the H200 on 2026-11-30, so last), OUTDIR/summary.md after every step. The same against
# torch.compile(flex_attention) (compiles for a while) runs only when GPU_CHECK_STEPS names flex.
# A pytest step stopped by its timeout gets SIGINT, so that it still prints its summary and writes
# its junit file; every step is killed 15 s after its signal.
# The decoder and model benchmarks time one CPU thread, so they are left to the CPU runs.
# The pooling check (GPU_CHECK_STEPS=pool = "build pool_tests pool_paths", one lent call
# of about 5 minutes, at most 8.8 by the timeouts): (p1) the tests of the opt-in pooling paths on
# CUDA tensors (CUDA variants v2 and radix, Triton kernel="onchip", none run on a GPU before: this
# is their first run; the default paths' own tests are in step 3); (p2)
# benchmarks/kernels/pool_paths.py: every path checked against the default CUDA kernel on the timed inputs,
# then timed side by side (N 1024, V 16384 / 32768 / 65536, top_k 0 / 2000, top_p 1 / 0.9, CFG on;
# sample_residual at V 16384 / 65536), into OUTDIR/pool_paths.json, rewritten after every row.
# Neither pooling step runs by default (the default call has no room left for them).
# OUTDIR receives at most six files (the device tool brings back eight): summary.md and logs.tgz
# (both rewritten after every step), results.tgz (the new benchmarks/results JSON files),
# pool_paths.json (pooling check), and for a later run on the same software the stripped extension
# and Triton's cache. Each step has a timeout, cut to what is left of GPU_CHECK_BUDGET seconds
# (default 540: the call ends inside the device's 10 minutes a command; a step with under 20 s
# left is skipped and says so in the summary).
set -uo pipefail

OUT="${1:?usage: benchmarks/gpu_check.sh OUTDIR [--dry-run]}"
DRY=0
[[ "${2:-}" == "--dry-run" ]] && DRY=1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT"
mkdir -p "$OUT"
# The logs live beside OUTDIR, not in it (the device tool brings back eight files): packed into
# OUTDIR/logs.tgz with the summary after every step.
LOGS="${GPU_CHECK_LOGS:-${TMPDIR:-/tmp}/specdec-gpu-check-logs}"
XDIST=""
"$PY" -c "import xdist" 2>/dev/null && XDIST="-n ${TEST_WORKERS:-8}"
TIMEOUT_FLAG=""
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_FLAG="--timeout 150"
# The system compiler, which built torch, not whatever CXX names: the H200 image sets
# CXX=/opt/gcc/bin/g++, whose extension carried its own static libstdc++ and segfaulted the
# first time an error message formatted a number (tests/kernels/test_build.py checks the linkage).
BUILD_CXX="${SPECDEC_CXX:-c++}"
BUILD_CC="${SPECDEC_CC:-cc}"
TESTS_LEFT_OUT="--ignore=tests/kernels/test_exact_sampling.py --ignore=tests/kernels/test_exact_sampling_gpu.py --ignore=tests/kernels/test_pool_gpu_machine_code.py --ignore=tests/kernels/test_pool_gpu_cuda.py --ignore=tests/kernels/test_pool_gpu_triton.py --deselect=tests/kernels/test_build.py::test_triton_kernels_lower_to_sm90a --deselect=tests/kernels/test_build.py::test_triton_pooling_kernels_use_128bit_loads"
KERNEL_BENCH="not flex_compiled and not opt_in_path and not decode_two_images and not ar_one_image"
COMPARE_IMAGES="${COMPARE_IMAGES:-16}"  # enough for times on a GPU, not for FD

STEPS=(
  "build|170|env SPECDEC_NO_EXT=1 $PY -m pip install -q --no-build-isolation --no-deps --no-index -e . && env SPECDEC_CUDA=1 CXX=$BUILD_CXX CC=$BUILD_CC MAX_JOBS=\${MAX_JOBS:-16} $PY setup.py -q build_ext --inplace && $PY -c 'import specdec, json; print(json.dumps(specdec.build_info())); print(specdec.switches.describe())'"
  # Exact mode's CUDA and Triton race kernels, bit for bit against the reference and by the
  # chi-square test of the tokens (never run on a GPU); the tests step leaves their files out.
  "exact|60|$PY -m pytest -q -p no:cacheprovider tests/kernels/test_exact_sampling.py tests/kernels/test_exact_sampling_gpu.py -k 'cuda or triton or gpu' --tb=short -rfEs"
  # (the machine-code checks expect the pinned Triton's lowering, the device has its own; the opt-in
  # pooling paths are the pool check's; exact sampling is the step above)
  "tests|170|$PY -m pytest -q -p no:cacheprovider tests/kernels tests/decoding/test_decoding_cuda.py tests/decoding/test_engine.py $TESTS_LEFT_OUT $XDIST $TIMEOUT_FLAG --tb=short -rfEs --durations=15 --junitxml=$LOGS/junit.xml"
  "engine_eager|90|$PY benchmarks/decoders/record_engine.py --device cuda --num-images $COMPARE_IMAGES --batch-sizes 1,16 --modes eager"
  # (every decode runs on the scheduler, whose compiled passes replay CUDA graphs only with the switch)
  "engine|150|env SPECDEC_CONTINUOUS_GRAPHS=1 $PY benchmarks/decoders/record_engine.py --device cuda --num-images $COMPARE_IMAGES --batch-sizes 1,16 --modes compiled --methods ar,mulo,ssd"
  "attn_paths|120|env SPECDEC_BENCH_E2E=0 $PY benchmarks/run.py -k opt_in_path"
  "limits|30|$PY benchmarks/machine/device_limits.py $LOGS/limits.json"
  "bench|130|env SPECDEC_BENCH_E2E=0 $PY benchmarks/run.py -k '$KERNEL_BENCH'"
  "compare|110|$PY benchmarks/decoders/record_compare.py --num-images $COMPARE_IMAGES --device cuda"
  "flex|100|env SPECDEC_BENCH_E2E=0 $PY benchmarks/run.py -k flex_compiled"
  "pool_tests|180|$PY -m pytest -q -p no:cacheprovider tests/kernels/test_pool_gpu_cuda.py tests/kernels/test_pool_gpu_triton.py tests/kernels/test_top_p.py::test_cuda_shared_memory_kernels_match_the_reference $XDIST $TIMEOUT_FLAG --tb=short -rfEs --junitxml=$LOGS/pool_junit.xml"
  "pool_paths|180|$PY benchmarks/kernels/pool_paths.py $OUT/pool_paths.json"
  # The kernels against torch.compile of their reference, SDPA, FlexAttention and FlashInfer where
  # it imports (only when asked: GPU_CHECK_STEPS="... peers"; the headline shape, N 1024, V 16384).
  "peers|200|env SPECDEC_PEERS=headline $PY benchmarks/run.py --peers"
  # Continuous batching on CUDA, the scheduler's compiled passes replayed as CUDA graphs (opt-in until
  # this has run: only when asked, GPU_CHECK_STEPS="build continuous"): every method at 1 and 16,
  # lockstep and continuous, against ar in the same run.
  "continuous|240|env SPECDEC_CONTINUOUS_GRAPHS=1 $PY benchmarks/decoders/record_continuous.py --device cuda --grid 16 --modes compiled --concurrency 1,16 --num-images 32"
  # Real model sizes with random weights (only when asked: GPU_CHECK_STEPS="... real_size"): the
  # cost of a target pass against the tokens fed, compiled with CUDA graphs.
  "real_size|240|$PY benchmarks/decoders/record_real_size.py --device cuda --compile --layers 4 --tokens 1,16,64,256 --decode-models none"
)
# flex compiles for minutes: only when asked (GPU_CHECK_STEPS="... flex"). The default fills one
# 10-minute device call in the order of STEPS (measured on an H200 on 2026-11-30: build 52 s, the
# whole suite of then 105 s, bench 60 s, compare 91 s); what the budget leaves out is skipped.
SELECTED="${GPU_CHECK_STEPS:-build exact tests engine_eager engine attn_paths limits bench compare}"
[[ "$SELECTED" == pool ]] && SELECTED="build pool_tests pool_paths"
REQUIRED_FILES=(setup.py pyproject.toml tests/conftest.py benchmarks/run.py benchmarks/make_results.py
                benchmarks/machine/device_limits.py benchmarks/conftest.py benchmarks/decoders/record_engine.py
                benchmarks/kernels/pool_paths.py benchmarks/kernels/bench_kernel_peers.py benchmarks/decoders/record_real_size.py
                benchmarks/decoders/record_continuous.py benchmarks/decoders/record_compare.py
                tests/kernels/test_pool_gpu_cuda.py tests/kernels/test_pool_gpu_triton.py
                tests/decoding/test_decoding_cuda.py tests/decoding/test_engine.py tests/kernels/test_exact_sampling.py
                tests/kernels/test_exact_sampling_gpu.py tests/kernels/test_pool_gpu_machine_code.py)

if [[ $DRY == 1 ]]; then
  status=0
  command -v "$PY" >/dev/null || { echo "missing: $PY"; status=1; }
  for f in "${REQUIRED_FILES[@]}"; do [[ -f "$f" ]] || { echo "missing file: $f"; status=1; }; done
  ls benchmarks/*/bench_*.py >/dev/null 2>&1 || { echo "no benchmarks/*/bench_*.py"; status=1; }
  for mod in torch pytest pytest_benchmark hypothesis; do
    "$PY" -c "import $mod" 2>/dev/null || { echo "python module missing: $mod"; status=1; }
  done
  # (a --deselect of a name that no longer exists deselects nothing, silently)
  for name in $(grep -o -- '--deselect=[^ ]*' <<<"$TESTS_LEFT_OUT" | cut -d= -f2); do
    grep -q "def ${name##*::}(" "${name%%::*}" 2>/dev/null || { echo "deselected test missing: $name"; status=1; }
  done
  for py in benchmarks/run.py benchmarks/make_results.py benchmarks/machine/device_limits.py benchmarks/kernels/pool_paths.py benchmarks/decoders/record_real_size.py; do
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
rm -rf "$LOGS" && mkdir -p "$LOGS"     # (a warm machine's earlier call left its own)
nvidia-smi >"$LOGS/nvidia-smi-before.txt" 2>&1
before_results=$(ls benchmarks/results/*.json 2>/dev/null | sort)
# The whole call ends inside the device's limit on one command: each step's timeout is cut to what
# is left of BUDGET seconds, and a step with less than MIN_STEP left is skipped, so the summary is
# always written.
BUDGET="${GPU_CHECK_BUDGET:-540}"
MIN_STEP="${GPU_CHECK_MIN_STEP:-20}"
DEADLINE=$(( $(date +%s) + BUDGET ))

# The JSON files this run added to benchmarks/results, in one archive, remade after every step:
# a call cut off by the device's time limit still brings back what its finished steps measured.
save_results() {
  local new_results
  new_results=$(comm -13 <(echo "$before_results") <(ls benchmarks/results/*.json 2>/dev/null | sort))
  [[ -n "$new_results" ]] && tar czf "$OUT/results.tgz" $new_results
  return 0
}

declare -A RESULT SECONDS_TAKEN
# (once: importing torch and starting CUDA after every step cost seconds of the budget each time)
DEVICE_LINE=$("$PY" -c 'import torch, triton; print("Device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| triton", triton.__version__)' 2>/dev/null)
write_summary() {
  {
    echo "# specdec GPU check — $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "$DEVICE_LINE"
    echo
    echo "| step | result | seconds |"
    echo "|---|---|---|"
    for step in "${STEPS[@]}"; do
      name=${step%%|*}
      echo "| $name | ${RESULT[$name]:-not run} | ${SECONDS_TAKEN[$name]:-} |"
    done
    echo
    for name in exact tests pool_tests; do
      grep -E "^(FAILED|ERROR) " "$LOGS/$name.log" 2>/dev/null | head -n 40
      grep -E "passed|failed|error" "$LOGS/$name.log" 2>/dev/null | tail -n 1
    done
    echo
    [[ -f "$LOGS/limits.json" ]] && { echo '```'; cat "$LOGS/limits.json"; echo '```'; }
    for name in engine_eager engine compare continuous; do
      [[ -f "$LOGS/$name.log" ]] && { echo; echo "### $name"; echo '```'; tail -n 14 "$LOGS/$name.log"; echo '```'; }
    done
    [[ -f "$LOGS/pool_paths.log" ]] && { echo; echo "### pool_paths"; echo '```'; tail -n 130 "$LOGS/pool_paths.log"; echo '```'; }
  } >"$OUT/summary.md"
  tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
}

for step in "${STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<<"$step"
  [[ " $SELECTED " == *" $name "* ]] || continue
  left=$(( DEADLINE - $(date +%s) ))
  if (( left < MIN_STEP )); then
    RESULT[$name]="skipped (the budget of ${BUDGET}s was spent)"
    echo "== $name skipped: ${left}s of the budget left"
    continue
  fi
  (( limit > left )) && limit=$left
  echo "== $name (timeout ${limit}s)"
  start=$(date +%s)
  # (pytest on SIGINT prints its summary and writes its junit and benchmark files, run.py waits for
  # it; record_engine.py saves what it measured on SIGTERM, and the other record scripts at their end)
  signal=TERM
  [[ "$cmd" == *"-m pytest"* || "$cmd" == *"benchmarks/run.py"* ]] && signal=INT
  timeout -s "$signal" -k 15 "$limit" bash -c "$cmd" >"$LOGS/$name.log" 2>&1
  rc=$?
  SECONDS_TAKEN[$name]=$(( $(date +%s) - start ))
  RESULT[$name]=$([[ $rc == 0 ]] && echo ok || echo "FAILED (exit $rc)")
  tail -n 4 "$LOGS/$name.log"
  save_results
  write_summary
  if [[ $name == build && $rc != 0 ]]; then
    echo "build failed; see $LOGS/build.log"
    break
  fi
done
nvidia-smi >"$LOGS/nvidia-smi-after.txt" 2>&1

save_results
# For a later run on the same torch and Triton: the extension (stripped) and Triton's cache.
so=$(ls specdec/_C*.so 2>/dev/null | head -1)
[[ -n "$so" ]] && { cp "$so" "$OUT/"; strip --strip-debug "$OUT/$(basename "$so")" 2>/dev/null; }
[[ -d "$HOME/.triton/cache" ]] && tar czf "$OUT/triton_cache.tgz" -C "$HOME/.triton" cache
write_summary
cat "$OUT/summary.md"
if [[ " $SELECTED " == *" tests "* ]]; then
  [[ "${RESULT[build]:-}" == ok && "${RESULT[tests]:-}" == ok ]]
else
  [[ "${RESULT[build]:-}" == ok && "${RESULT[pool_tests]:-ok}" == ok ]]
fi
