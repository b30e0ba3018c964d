"""A supervised warm start on tool-call demonstrations, before RL on episodes.

Why: sampled at any temperature, SmolLM2-135M-Instruct never writes a well-formed
``<tool_call>`` for ``task=multiply`` (docs/AGENTS.md, "Measured on this machine"), so RL on
episodes sees only zero rewards. A few supervised steps on programmatically generated
transcripts teach the format; RL then trains on episodes that reach the reward. This is the
SFT-then-RL recipe of tool-integrated reasoning work (e.g. "ToRA: A Tool-Integrated Reasoning
Agent for Mathematical Problem Solving", arXiv:2309.17452, imitation learning on tool-use
trajectories before further training); the demonstrations here are generated, not sampled.

A demonstration is laid out token for token as an episode of :class:`rlpost.samplers.episode.EpisodeSampler`
would be: the prompt (``task.render_prompt``), model turn 1 (the call, ending at
``</tool_call>`` as a sampled turn stopped there would), the environment's answer rendered by
:func:`rlpost.samplers.episode.render_insert` from the environment's real reply, then the final
turn and the end-of-turn token. The loss is the mean negative log-likelihood of the model
turns' tokens (the prompt and the environment's tokens carry none, as in RL).

Usage (writes a Hugging Face model directory, then RL starts from it)::

    python -m rlpost.experiments.warmstart --out DIR -- +recipe=agent_multiply_grpo      # 10 steps x 4, lr 2e-4
    rlpost train +recipe=agent_multiply_grpo model.source=hf model.path=DIR
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from rlpost.config.compose import compose_config
from rlpost.core.errors import ConfigError
from rlpost.envs import make_env
from rlpost.models.loader import load_policy
from rlpost.run.checkpoint import save_hf
from rlpost.samplers.episode import render_insert
from rlpost.tasks import build_task


@dataclass
class Demonstration:
    """One tokenised demonstration episode.

    Attributes:
        prompt_ids: the templated prompt.
        response_ids: model turns and inserted environment text, in episode order.
        loss_mask: 1.0 on model-turn tokens, 0.0 on environment tokens (same length as ``response_ids``).
        turns: the model turns' texts.
    """

    prompt_ids: List[int]
    response_ids: List[int]
    loss_mask: List[float]
    turns: List[str]


def calculator_turns(example: Any) -> List[str]:
    """The model turns of a calculator demonstration for an arithmetic ``example``.

    Turn 1 calls the calculator on the example's expression (reasoning-gym ``basic_arithmetic``
    entries carry it in ``meta['entry']['metadata']['expression']``); the final turn, written
    after the tool's reply (``{result}`` is filled in from the environment), states it.

    Raises:
        ConfigError: the example has no expression (the task is not an arithmetic one).
    """
    md = ((example.meta or {}).get("entry") or {}).get("metadata") or {}
    expr = md.get("expression")
    if not expr:
        raise ConfigError("the warm start's calculator demonstrations need arithmetic examples with an expression "
                          "(reasoning-gym basic_arithmetic, e.g. task=multiply)")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expr
    return [call, f"{expr} = {{result}}"]


def build_demonstration(task: Any, example: Any, tokenizer: Any, env: Any, eos_id: int) -> Demonstration:
    """Tokenise the calculator demonstration of ``example`` as an episode (see the module docstring).

    The tool's reply is the environment's own (``env.step`` on turn 1), so the inserted text is
    what a real episode would insert.

    Raises:
        ConfigError: :func:`calculator_turns`; ValueError: the environment did not answer the call.
    """

    first, final = calculator_turns(example)
    step = env.step(first)
    if step.done or not step.messages or step.info.get("tool_errors"):
        raise ValueError(f"the environment did not answer the demonstration call {first!r}: {step}")
    result = step.messages[0]["content"].strip()
    final = final.format(result=result)
    ids: List[int] = []
    mask: List[float] = []
    t1 = list(tokenizer(first, add_special_tokens=False)["input_ids"])
    ins = render_insert(tokenizer, step.messages, after_eos=False)
    t2 = list(tokenizer(final, add_special_tokens=False)["input_ids"]) + [int(eos_id)]
    for part, m in ((t1, 1.0), (ins, 0.0), (t2, 1.0)):
        ids.extend(part)
        mask.extend([m] * len(part))
    return Demonstration(list(task.render_prompt(example, tokenizer)), ids, mask, [first, final])


def demonstration_nll(model: Any, demos: Sequence[Demonstration], pad_id: int) -> torch.Tensor:
    """Mean negative log-likelihood (nats per model-turn token) of ``demos`` under ``model``.

    Rows are right-padded ``prompt + response``; position ``t`` predicts token ``t + 1``; only
    response tokens with ``loss_mask`` 1 count (the token-mean over the batch).

    Returns:
        a scalar tensor (differentiable).
    """
    rows = [d.prompt_ids + d.response_ids for d in demos]
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), int(pad_id), dtype=torch.long)
    attn = torch.zeros(len(rows), L, dtype=torch.long)
    w = torch.zeros(len(rows), L)
    for i, (d, r) in enumerate(zip(demos, rows)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        w[i, len(d.prompt_ids): len(r)] = torch.tensor(d.loss_mask)
    dev = next(model.parameters()).device
    ids, attn, w = ids.to(dev), attn.to(dev), w.to(dev)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    wt = w[:, 1:]
    sel = wt > 0  # the log-softmax only where the loss counts (the vocabulary is 49k wide)
    lp = torch.log_softmax(logits[sel].float(), -1).gather(-1, ids[:, 1:][sel][:, None]).squeeze(-1)
    return -(lp * wt[sel]).sum() / wt.sum().clamp(min=1.0)


def warm_start(model: Any, demos: Sequence[Demonstration], pad_id: int, steps: int, batch_size: int = 8,
               lr: float = 1e-4, seed: int = 0, log: Optional[Any] = print) -> List[float]:
    """``steps`` AdamW steps of :func:`demonstration_nll` on batches drawn from ``demos``.

    Args:
        model: the policy (updated in place).
        demos: the demonstrations (a shuffled pass, then the next, ...).
        steps, batch_size, lr: the schedule (constant learning rate, gradient norm clipped to 1).
        seed: the shuffling seed.
        log: called with one line per step, or None.

    Returns:
        the loss of each step (nats per model-turn token).

    Raises:
        ValueError: no demonstrations, or ``steps`` / ``batch_size`` < 1.
    """
    if not demos or steps < 1 or batch_size < 1:
        raise ValueError("warm_start needs demonstrations, steps >= 1 and batch_size >= 1")
    rng = random.Random(seed)
    order: List[int] = []
    # foreach=False: no temporary copies of all parameters per update (the machine it was measured on is small)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0, foreach=False)
    model.train()
    losses = []
    for s in range(steps):
        if len(order) < batch_size:
            perm = list(range(len(demos)))
            rng.shuffle(perm)
            order.extend(perm)
        idx, order = order[:batch_size], order[batch_size:]
        t0 = time.perf_counter()
        loss = demonstration_nll(model, [demos[i] for i in idx], pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        del loss
        if log is not None:
            log(f"warm start step {s + 1}/{steps}: nll {losses[-1]:.4f} ({time.perf_counter() - t0:.1f} s)")
    model.eval()
    return losses


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m rlpost.experiments.warmstart --out DIR [--steps N --batch-size B --lr LR --examples K] -- OVERRIDES``.

    Builds the run's task, model and environment from the Hydra ``OVERRIDES`` (the same as
    ``rlpost train``'s, e.g. ``+recipe=agent_multiply_grpo``), trains on calculator
    demonstrations of the first ``K`` training examples, and saves the model and tokenizer to
    ``DIR`` (load with ``model.source=hf model.path=DIR``).
    """
    ap = argparse.ArgumentParser(prog="python -m rlpost.experiments.warmstart", description=main.__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--examples", type=int, default=256)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    from pathlib import Path

    cfg = compose_config(list(a.overrides))
    if cfg.sampler.name != "episode":
        raise ConfigError("the warm start demonstrates tool calls: pick an environment (env=calculator or a +recipe=agent_* recipe)")
    torch.manual_seed(int(cfg.seed))
    task = build_task(cfg.task)
    model, tok = load_policy(cfg.model, torch.float32, seed=int(cfg.seed))
    p = cfg.sampler.params
    env_params = dict(p.env_params or {})
    demos = []
    for ex in task.train_examples()[: a.examples]:
        env = make_env(p.env, env_params)
        env.reset(ex)
        demos.append(build_demonstration(task, ex, tok, env, tok.eos_token_id))
    t0 = time.perf_counter()
    losses = warm_start(model, demos, tok.pad_token_id, a.steps, a.batch_size, a.lr, seed=int(cfg.seed))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    save_hf(model, tok, out)
    print(f"warm start: {len(demos)} demonstrations, {a.steps} steps, nll {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"{time.perf_counter() - t0:.0f} s; saved to {out} (model.source=hf model.path={out})")


if __name__ == "__main__":
    import sys

    from rlpost.core.errors import DataError

    try:
        main()
    except (ConfigError, DataError) as e:  # bad input: one line and exit status 2, as rlpost's CLI does
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
