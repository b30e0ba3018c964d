#!/usr/bin/env bash
# Create .venv and install rlpost with everything its run and its tests need.
# torch is installed first from the pinned CPU build (2.13.0) so that no CUDA
# build is pulled in by a plain `torch` requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, transformers, hydra, deepspeed, rlpost; print('rlpost ready: torch', torch.__version__)"
