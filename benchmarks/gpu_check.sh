#!/usr/bin/env bash
# One-GPU check of sdc-forensics (issue 11, part 6): CUDA tests, then GPU benchmarks, in < 8 minutes.
#
# Run from the repository root on a machine with one NVIDIA GPU, torch with CUDA and (for the
# fast path) Triton. It installs nothing from the network: the package is installed with
# 'pip install --no-deps --no-build-isolation -e .' if it can be, and PYTHONPATH=. is set anyway.
#
#   bash benchmarks/gpu_check.sh                 # log to a temporary file (path printed)
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # log, JUnit XML, benchmark JSON and summary in OUT
#
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S (default 460: total seconds, each
# step is cut to what is left), GPU_CHECK_SIZES_MB (default "256 1024": fingerprint benchmark sizes).
# Steps never abort the script: each is timed, its failure or timeout recorded, and a table of
# every step and the headline figures is printed at the end. Exit status: 0 when every step
# passed or was unavailable (exit 75: e.g. bench_overhead.py without --device), 1 otherwise.
# docs/gpu.md says what each step checks.

set -u

PYTHON=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-460}
SIZES_MB=${GPU_CHECK_SIZES_MB:-"256 1024"}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    RESULTS=$OUT
else
    RESULTS=$(mktemp -d /tmp/gpu_check.XXXXXX)
fi
LOG=$RESULTS/gpu_check.log
exec > >(tee -a "$LOG") 2>&1

export PYTHON REPO RESULTS
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
STEPS=()     # "name|status|seconds|note"
FAILED=0

record() {  # name status seconds note
    STEPS+=("$1|$2|$3|$4")
    case "$2" in ok | skipped*) ;; *) FAILED=1 ;; esac
}

step() {  # name limit_s note command...: runs the command (a program; functions via bash -c) under timeout
    local name=$1 limit=$2 note=$3
    shift 3
    local left=$((DEADLINE - $(date +%s)))
    if [ "$left" -lt 15 ]; then
        echo "=== $name: skipped, the time budget of ${BUDGET_S}s is spent"
        record "$name" "skipped (budget)" 0 "$note"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo
    echo "=== $name (limit ${limit}s): $*"
    local t0 t1 rc status
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    t1=$(date +%s.%N)
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${limit}s" ;;
        75) status="skipped (not available)" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    echo "=== $name: $status"
    record "$name" "$status" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", b - a }')" "$note"
}

echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $REPO, results in $RESULTS, budget ${BUDGET_S}s"

# --- 1. what the machine has ---------------------------------------------------------------
environment() {
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    else
        echo "nvidia-smi: not found"
    fi
    "$PYTHON" - <<'EOF'
import importlib, importlib.metadata, sys
print("python", sys.version.split()[0], sys.executable)
missing = []
for name in ("torch", "triton", "numpy", "numba", "click", "rich", "pytest", "safetensors", "hypothesis",
             "jsonschema", "orjson", "matplotlib"):
    try:
        importlib.import_module(name)
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        print(f"  {name:12s} {version}")
    except Exception as error:  # noqa: BLE001
        missing.append(name)
        print(f"  {name:12s} MISSING ({type(error).__name__}: {error})")
import torch
print("torch.cuda.is_available():", torch.cuda.is_available(), "| CUDA", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
needed = {"torch", "numpy", "click", "rich"}
if missing:
    print("missing:", ", ".join(missing), "- without triton the CUDA fast path is off (torch path measured);",
          "without numba the CPU kernel is off; tests needing hypothesis/safetensors/jsonschema/orjson are not in the cuda set")
sys.exit(1 if (needed & set(missing)) or not torch.cuda.is_available() else 0)
EOF
}
export -f environment
step "environment" 60 "GPU, python packages, what is missing" bash -c environment

# --- 2. the package, without the network --------------------------------------------------
install() {
    if "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index -q -e . ; then
        echo "installed editable (console script: $(command -v sdc-forensics || echo 'not on PATH'))"
    else
        echo "pip install -e . failed: using PYTHONPATH=$REPO only (the sdc-forensics command may be missing)"
    fi
    "$PYTHON" -c "import sdc_forensics, sys; print('sdc_forensics from', sdc_forensics.__file__)"
}
export -f install
step "install" 90 "pip -e offline, else PYTHONPATH" bash -c install

# --- 3. the kernel on this GPU, in a few seconds (before the long test run) ---------------
smoke() {
    "$PYTHON" - <<'EOF'
import time, torch
from sdc_forensics.fingerprint import constants as C, core, reference, triton_kernel as tk
device = torch.device("cuda")
print("triton_kernel.available:", tk.available(device))
kernel_path = getattr(core, "kernel_path", None)
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    print(f"core.kernel_path(cuda, {dtype}):", kernel_path(device, dtype) if kernel_path else "core has no kernel_path()")
ok, why = tk.available(device)
if not ok:
    raise SystemExit(f"the Triton kernel cannot run here: {why}")
bad = 0
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for numel in (1, 1025, 4097, 1_000_003):
        x = torch.randn(numel, device=device).to(dtype)
        t0 = time.perf_counter()
        out = tk.partials(x, k=8, seed=C.DEFAULT_SEED, block_offset=0, with_digest=True).cpu()
        seconds = time.perf_counter() - t0
        low, high = out[:2].view(torch.int64).tolist()
        raw = x.cpu().contiguous().view(torch.uint8).numpy()
        total = (low + (high << 32) + raw.size * C.digest_length_weight(C.DEFAULT_SEED)) % (1 << 64)
        same = C.fmix64(total) == reference.digest_bytes(raw)
        bad += not same
        print(f"  {str(dtype):15s} n={numel:>9d} digest == reference: {same}  ({seconds * 1e3:.0f} ms incl. any compile)")
raise SystemExit(1 if bad else 0)
EOF
}
export -f smoke
step "triton smoke" 90 "4 dtypes x 4 sizes, digest vs numpy" bash -c smoke

# --- 4. every CUDA-marked test -------------------------------------------------------------
step "cuda tests" 210 "pytest -m cuda (fingerprints, Triton kernel, CUDA replay of demo incidents)" \
    "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider -rfEs --junitxml="$RESULTS/cuda-tests.xml" tests/

# --- 4b. issue 21: a 4-rank DDP job on this GPU certified by an exact GPU replay, never by a CPU one
# (without a GPU: the same on CPU, the plumbing only; the script says which parts it skipped)
step "certify gpu job" 180 "4 ranks on one GPU (gloo over CUDA), default and replayable(): GPU replay exact, CPU replay tolerant" \
    "$PYTHON" benchmarks/gpu_certify_check.py --out "$RESULTS"

# --- 5. fingerprint throughput: chosen path vs torch path vs torch.sum ----------------------
# shellcheck disable=SC2086 # SIZES_MB is a list of words
step "bench fingerprint" 90 "sizes $SIZES_MB MB, fp32 and bf16, --path both" \
    bash -c "set -o pipefail; $PYTHON benchmarks/bench_fingerprint.py --device cuda --sizes-mb $SIZES_MB --runs 5 --path both --json > '$RESULTS/bench_fingerprint.json'"

# --- 6. the Triton kernel's launch settings, to pick the defaults from (warps, unroll, registers, grid)
step "sweep triton" 60 "launch settings of the kernel, 1 GB fp32 and bf16" \
    bash -c "set -o pipefail; $PYTHON benchmarks/bench_fingerprint.py --device cuda --sizes-mb 1024 --runs 5 --sweep-triton --json > '$RESULTS/sweep_triton.json'"

# --- 7. recorder overhead on the GPU (bench_overhead.py --device cuda, when it has that option)
overhead() {
    if ! "$PYTHON" benchmarks/bench_overhead.py --help 2>/dev/null | grep -q -- "--device"; then
        echo "bench_overhead.py has no --device option yet: the GPU recorder overhead is not measured"
        return 75
    fi
    "$PYTHON" benchmarks/bench_overhead.py --device cuda --json > "$RESULTS/bench_overhead.json"
}
export -f overhead
step "bench overhead" 90 "recorder overhead, bench_overhead.py --device cuda" bash -c overhead

# --- summary --------------------------------------------------------------------------------
{
    echo
    echo "## gpu_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START ))s in all)"
    echo
    echo "| step | status | seconds | what |"
    echo "| --- | --- | ---: | --- |"
    for row in "${STEPS[@]}"; do
        IFS='|' read -r name status seconds note <<<"$row"
        echo "| $name | $status | $seconds | $note |"
    done
    echo
    "$PYTHON" - "$RESULTS" <<'EOF'
import json, pathlib, sys
results = pathlib.Path(sys.argv[1])
try:
    import xml.etree.ElementTree as ET
    suites = ET.parse(results / "cuda-tests.xml").getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    print(f"- cuda tests: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
          + (" (ALL SKIPPED: no CUDA device or no triton?)" if counts["tests"] and counts["skipped"] == counts["tests"] else ""))
except (OSError, ET.ParseError, AttributeError) as error:
    print(f"- cuda tests: no JUnit report ({type(error).__name__})")
try:
    sweep = json.loads((results / "sweep_triton.json").read_text())
    for dtype, rows in sorted(sweep.items()):
        best = rows[0]
        print(f"- triton best for {dtype}: {best['gb_per_s']} GB/s = {best['x_sum']}x torch.sum with warps {best['warps']}, "
              f"unroll {best['unroll']}, max registers {best['max_registers']}, {best['programs_per_sm']} programs/SM")
except (OSError, ValueError, LookupError) as error:
    print(f"- sweep_triton.json: no figures ({type(error).__name__})")
try:
    cert = json.loads((results / "gpu_certify.json").read_text())
    print(f"- certify gpu job: {cert['checks'] - cert['failed']}/{cert['checks']} checks passed on {cert['device']}"
          + "".join(f"; {s}" for s in cert["skipped"]))
except (OSError, ValueError, LookupError) as error:
    print(f"- gpu_certify.json: no figures ({type(error).__name__})")
for name in ("bench_fingerprint.json", "bench_overhead.json"):
    path = results / name
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        print(f"- {name}: no figures ({type(error).__name__})")
        continue
    for key, fig in sorted(figures.items()):
        if isinstance(fig, dict) and "value" in fig:
            goal = "" if fig.get("goal") is None else f", goal {fig['goal']}, {'met' if fig.get('met') else 'NOT met'}"
            print(f"- {key}: {fig['value']} {fig.get('unit', '')}{goal}")
        else:
            print(f"- {key}: {json.dumps(fig)[:200]}")
EOF
} | tee "$RESULTS/summary.md"
echo "log: $LOG"
exit $FAILED
