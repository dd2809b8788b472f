#!/usr/bin/env bash
# One prepared GPU check: the GPU-marked tests, then the kernel and decode-step benchmark
# (`python -m bench.decode_step`, which runs `bench.kernels` plus the step), then a short
# table of the targets. Run from the repository root on a CUDA machine:
#
#     bash bench/gpu_check.sh            # results in $OUT (default bench-results/)
#
# It installs nothing from any registry. If the machine's Python lacks the project's pydantic
# stack, it installs the wheels found in .whl/ (fetch them beforehand, where a registry is
# reachable, with bench/gpu_wheels.sh, and carry .whl along) into /tmp/site, nowhere else.
# Budget: each stage has its own time limit (tests 3 min, benchmark 4.5 min), so that the
# benchmark always gets its turn and the whole run ends inside ten minutes.
set -uo pipefail

PY=${PYTHON:-python3}
OUT=${OUT:-bench-results}
TEST_LIMIT_S=${TEST_LIMIT_S:-180}
BENCH_LIMIT_S=${BENCH_LIMIT_S:-270}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to $PY; nothing to check" >&2
  exit 2
fi
nvidia-smi -L 2>/dev/null || true

if ! "$PY" -c 'import pydantic, pydantic_settings, redis, gguf' 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
missing=$("$PY" - <<'PYEOF'
import importlib.util
need = ["torch", "triton", "transformers", "pytest", "numpy", "safetensors", "pydantic",
        "pydantic_settings", "dotenv", "typing_inspection", "annotated_types", "redis", "gguf"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: $PY lacks: $missing (run bench/gpu_wheels.sh where a registry is reachable" \
    "and carry .whl)" >&2
  exit 1
fi
"$PY" -c 'import torch, triton, transformers as t; print("torch", torch.__version__,
"triton", triton.__version__, "transformers", t.__version__, torch.cuda.get_device_name())'

# Only the files holding GPU tests: collecting the whole suite would import the gateway's
# and the bus's packages, which the GPU image does not carry.
GPU_TESTS=(
  tests/kernels/test_gpu.py
  tests/kernels/test_gpu_ssm.py
  tests/kernels/test_fused_moe.py
  tests/unit/worker/test_worker_cuda.py
  tests/unit/worker/test_worker_families_cuda.py
  tests/unit/worker/test_worker_cuda_graphs.py
  tests/unit/worker/test_worker_noise.py
)
timeout "$TEST_LIMIT_S" "$PY" -m pytest -m gpu -q -ra -p no:cacheprovider --durations=12 "${GPU_TESTS[@]}" \
  2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

timeout "$BENCH_LIMIT_S" "$PY" -m bench.decode_step --out "$OUT/kernels.json" 2>&1 \
  | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

"$PY" - "$OUT/kernels.json" "$tests_rc" "$bench_rc" <<'PYEOF'
import json, sys
from pathlib import Path

path, tests_rc, bench_rc = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
print(f"\n=== gpu_check summary: tests rc={tests_rc} bench rc={bench_rc} ===")
if not path.is_file():
    print("no benchmark results")
    sys.exit(0)
report = json.loads(path.read_text())
copy = report.get("copy_bandwidth_gbps")
print(f"{report['device']}  copy bandwidth " + (f"{copy:.0f} GB/s" if copy else "not measured"))
for row in report.get("kernels", []):
    if row["target"] is not None:
        frac = row["bw_fraction"] or 0.0
        verdict = "meets" if row["meets_target"] else "MISSES"
        print(f"{row['name']:<18} {row['shape']:<44} {row['time_us']:9.1f} us "
              f"{100 * frac:5.1f}% of copy ({verdict} {100 * row['target']:.0f}%)")
print(f"{'decode step':<44} {'us':>9} {'floor us':>9} {'x floor':>8} {'HF us':>9} {'vs HF':>6}")
for row in report.get("decode_step", []):
    e = row["extra"]
    if not row["time_us"]:
        print(f"{row['shape']:<44} {e.get('note', 'skipped')}")
        continue
    floor = e.get("floor_us")
    ratio = f"{row['time_us'] / floor:8.2f}" if floor else f"{'-':>8}"
    floor_s = f"{floor:9.0f}" if floor else f"{'-':>9}"
    hf = e.get("transformers_us")
    hf_s = f"{hf:9.0f}" if hf else f"{'-':>9}"
    speed = e.get("speedup_vs_transformers")
    speed_s = f"{speed:5.1f}x" if speed else f"{'-':>6}"
    flags = []
    if row["target"] is not None and row["meets_target"] is not None:
        flags.append(("meets" if row["meets_target"] else "MISSES") + " 1.5x floor")
    if speed:
        flags.append(("meets" if speed >= 3 else "MISSES") + " 3x HF")
    if not row["ok"]:
        flags.append(f"CHECK FAILED rel err {row['rel_error']:.2e}")
    print(f"{row['shape']:<44} {row['time_us']:9.0f} {floor_s} {ratio} {hf_s} {speed_s}  "
          + ", ".join(flags))
PYEOF
exit $(( tests_rc != 0 || bench_rc != 0 ))
