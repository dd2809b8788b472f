#!/usr/bin/env bash
# Fetches, on a machine with package-registry access, the wheels bench/gpu_check.sh needs
# on a GPU machine whose Python (3.12) has torch, triton, transformers and pytest but not
# the project's pydantic stack, nor redis and gguf (which the worker's modules import). They land in .whl/ (kept out of git through
# .git/info/exclude), to be carried to the GPU machine. Run from the repository root.
set -euo pipefail

WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  pydantic-settings==2.16.3
  annotated-types==0.8.0
  typing-inspection==0.4.5
  python-dotenv==1.2.4
  redis==8.2.0
  gguf==0.19.0
)
PY=${PYTHON:-python3}

grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any \
  -d .whl "${WHEELS[@]}"
ls -l .whl
