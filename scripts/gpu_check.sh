#!/usr/bin/env bash
# GPU smoke check for issue 5's engines: vLLM rollouts and a bf16 DeepSpeed update, a few steps each.
# Self-contained: run from the repository root on a machine with one NVIDIA GPU.
#
#   bash scripts/gpu_check.sh [STEPS]        (default 3)
#
# Installs what it needs into .venv-gpu (vllm brings its matching CUDA torch), then:
#   1. vLLM alone: generate 64 x 128 tokens, push weights in memory, generate again; prints tokens/s.
#   2. rlpost train rollout=vllm trainer=deepspeed precision=bf16 for STEPS steps; prints s/step,
#      rollout tokens/s and update seconds from metrics.jsonl.
#   3. the same with precision=rollout_fp8 (real fp8 rollouts) and its mismatch/* metrics.
set -euo pipefail
STEPS="${1:-3}"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "no NVIDIA GPU visible" >&2; exit 1; }

if [ ! -x .venv-gpu/bin/python ]; then
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q --upgrade pip
  .venv-gpu/bin/pip install -q vllm deepspeed
  .venv-gpu/bin/pip install -q -e . || .venv-gpu/bin/pip install -q --no-deps -e .
fi
PY=.venv-gpu/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline

echo "== 1. vLLM engine: generate, in-memory weight push, generate"
$PY - <<'PYEOF'
import time, torch
from rlpost.config.compose import compose_config
from rlpost.models.loader import load_policy
from rlpost.rollout import build_engine
from rlpost.rollout.base import SamplingParams
cfg = compose_config(["rollout=vllm", "precision=bf16", "logger=none"])
policy, tok = load_policy(cfg.model, torch.float32, seed=0)
policy = policy.cuda()
eng = build_engine(cfg, policy, tok, torch.device("cuda"))
prompts = [tok(f"What is {i} + {i}?")["input_ids"] for i in range(64)]
sp = SamplingParams(max_new_tokens=128, temperature=1.0, seed=0)
eng.generate(prompts[:4], sp)  # warm-up
t = time.perf_counter(); g = eng.generate(prompts, sp); dt = time.perf_counter() - t
print(f"vllm generate: {g.num_tokens} tokens in {dt:.2f}s = {g.num_tokens / dt:.0f} tokens/s")
t = time.perf_counter(); eng.sync_weights(policy); print(f"vllm weight push (in memory): {time.perf_counter() - t:.2f}s")
g2 = eng.generate(prompts, sp)
print(f"after push: {g2.num_tokens} tokens; mean rollout log-prob {float((g2.rollout_logprobs * g2.response_mask).sum() / g2.response_mask.sum()):.3f}")
PYEOF

summ() {
  $PY - "$1" <<'PYEOF'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
for r in recs:
    mm = {k: round(v, 4) for k, v in r.items() if k.startswith("mismatch/")}
    print(f"step {r['step']}: {r['time/step_s']:.2f} s/step, rollout {r['throughput/rollout_tokens_per_s']:.0f} tokens/s, "
          f"update {r['time/update_s']:.2f}s, reward {r['reward/mean']:.3f} {mm}")
PYEOF
}

OUT=$(mktemp -d)
echo "== 2. rollout=vllm trainer=deepspeed precision=bf16 ($STEPS steps)"
$PY -m rlpost.cli train rollout=vllm trainer=deepspeed trainer.zero_stage=2 precision=bf16 logger=jsonl \
  steps="$STEPS" eval.at_end=false checkpoint.every=0 hydra.run.dir="$OUT/bf16"
summ "$OUT/bf16"

echo "== 3. fp8 rollouts (vLLM quantization=fp8), bf16 DeepSpeed update, TIS ($STEPS steps)"
$PY -m rlpost.cli train rollout=vllm trainer=deepspeed precision=rollout_fp8 logger=jsonl \
  steps="$STEPS" eval.at_end=false checkpoint.every=0 hydra.run.dir="$OUT/fp8"
summ "$OUT/fp8"
echo "gpu_check: ok ($OUT)"
