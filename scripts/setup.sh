#!/usr/bin/env bash
# Create .venv and install rlpost with everything its run and its tests need.
# torch is installed first from the pinned CPU build (2.13.0) so that no CUDA
# build is pulled in by a plain `torch` requirement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip's build step (rlpost's own editable build, DeepSpeed's sdist) prints setuptools'
# notices: blocks that start with "...SetuptoolsDeprecationWarning: ..." (or the editable
# build's "...BuildBackendWarning: Editable installation.") and end with a "!!" line and
# the offending source line. They concern packaging metadata,
# not the user, so they are dropped; everything else pip prints is kept.
quiet() {
  awk '
    /Setuptools[A-Za-z]*Warning|BuildBackendWarning/ { skip = 1; bangs = 0; next }
    skip && /^[[:space:]]*!!/ { bangs++; if (bangs == 2) { skip = 2 }; next }
    skip == 2 { skip = 0; next }   # the source line printed after the closing "!!"
    skip { next }
    /is ignored/ { next }
    { print }
  '
}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | quiet
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | quiet
fi
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | quiet
# deepspeed is checked, not imported: importing it prints an accelerator warning on CPU machines
.venv/bin/python -c "import importlib.util, torch, transformers, hydra, rlpost; assert importlib.util.find_spec('deepspeed'), 'deepspeed missing'; print('rlpost ready: torch', torch.__version__)"
