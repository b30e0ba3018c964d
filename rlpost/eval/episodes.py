"""Held-out evaluation of multi-turn episodes (``sampler=episode``): greedy episodes with the
training environment, scored by the task's verifier (plus the environment's reward when the
sampler weights it)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from rlpost.eval.evaluate import _ci_fields, progress_bar
from rlpost.rollout.base import SamplingParams
from rlpost.samplers.base import SamplerContext


def _one_row_per_episode(res: Any) -> Any:
    """The rows ``extras['episode_final_row']`` marks (``[B]`` bool), when the sampler writes several rows per
    episode (``sampler=agentflow``: one per planner turn, each carrying the episode's reward); else ``res``."""
    keep = res.extras.get("episode_final_row")
    if keep is None:
        return res
    import dataclasses

    from rlpost.samplers.base import select_rows

    rows = torch.nonzero(keep.bool(), as_tuple=False).flatten().tolist()
    extras = {k: v[rows] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == keep.shape[0] else v
              for k, v in res.extras.items()}
    return dataclasses.replace(res, generation=select_rows(res.generation, rows), group_index=res.group_index[rows],
                               extras=extras, rewards=None if res.rewards is None else res.rewards[rows],
                               prompt_position=None if res.prompt_position is None else res.prompt_position[rows])


def evaluate_episodes(sampler: Any, engine: Any, tokenizer: Any, task: Any, reward_fn: Any, eval_cfg: Any,
                      seed: int = 0, progress: Optional[str] = None, leave: bool = True) -> Dict[str, Any]:
    """Greedy episodes on the first ``eval.limit`` held-out examples of ``task``.

    One episode per problem with the sampler's environment, turn and token limits, greedy
    decoding and ``eval.max_new_tokens`` per turn; no transcripts are written.

    Returns:
        ``{"n", "accuracy", "accuracy_ci_low", "accuracy_ci_high", "ci_low", "ci_high",
        "tool_call_frac", "turns_mean", "truncated_frac", "records"}`` (95% bootstrap CI over problems):
        ``accuracy`` is the share of episodes whose final answer the verifier scores > 0.5
        (or, with ``env_reward_weight`` set, whose total reward is > 0.5); ``records`` one
        dict per problem (index, final text, turns, tool calls, correct); also ``task`` and
        ``time_s``. ``progress`` and ``leave``: the console bar, as :func:`rlpost.eval.evaluate.evaluate`'s.
    """
    import time

    t0 = time.monotonic()

    examples = list(task.eval_examples())[: int(eval_cfg.limit)]
    saved = (sampler.examples, sampler.transcripts)
    sampler.examples, sampler.transcripts = examples, False
    bs = max(1, int(getattr(eval_cfg, "batch_size", 64) or 64))
    records: List[Dict[str, Any]] = []
    turns, calls, trunc = [], [], []
    bar = progress_bar(progress, len(examples), leave=leave)
    try:
        for s in range(0, len(examples), bs):
            chunk = list(range(s, min(len(examples), s + bs)))
            prompts = [task.render_prompt(examples[i], tokenizer) for i in chunk]

            def score(rows, texts, lengths, chunk=chunk):
                return reward_fn.score(texts, [examples[chunk[r]] for r in rows], lengths)

            ctx = SamplerContext(score=score, step=0, seed=seed, prompt_indices=chunk, rollout_counts=[1] * len(chunk))
            sp = SamplingParams(max_new_tokens=int(eval_cfg.max_new_tokens), greedy=True, seed=seed)
            res = sampler.sample(engine, prompts, sp, ctx)
            res = _one_row_per_episode(res)
            g = res.generation
            if res.rewards is None:
                r = reward_fn.score(g.texts, [examples[i] for i in chunk], g.response_mask.sum(-1))
                ok = r.components.get("correct", r.total) > 0.5
            else:
                ok = res.rewards > 0.5
            for j, i in enumerate(chunk):
                records.append({"index": examples[i].index, "response": g.texts[j], "correct": bool(ok[j]),
                                "turns": int(res.extras["episode_turns"][j]),
                                "tool_calls": int(res.extras["episode_tool_calls"][j])})
            turns.append(res.extras["episode_turns"])
            calls.append(res.extras["episode_tool_calls"])
            trunc.append((~g.finished).float())
            bar.update(len(chunk))
    finally:
        bar.close()
        sampler.examples, sampler.transcripts = saved

    n = len(records)
    t, c = torch.cat(turns), torch.cat(calls)
    out: Dict[str, Any] = {"n": n}
    # the same bootstrap CI as single-turn evaluation (rlpost.eval.evaluate), so summaries and compare read it
    out.update(_ci_fields("accuracy", [float(r["correct"]) for r in records], seed, int(getattr(eval_cfg, "n_boot", 1000) or 1000)))
    out["ci_low"], out["ci_high"] = out["accuracy_ci_low"], out["accuracy_ci_high"]
    out.update({"tool_call_frac": float((c > 0).float().mean()), "turns_mean": float(t.mean()),
                "truncated_frac": float(torch.cat(trunc).mean()), "records": records,
                "task": task.name, "time_s": time.monotonic() - t0})
    return out
