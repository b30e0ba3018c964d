"""How often does the model write a well-formed calculator call on its first turn? (docs/AGENTS.md)

Prints, per prompt variant and temperature, the well-formed ``<tool_call>`` count among
``--prompts`` training prompts x 4 samples (40 tokens, stopped at ``</tool_call>``) and how many
of them carry the exact expression. Variants: the preset's system prompt (``current``), a
shorter one (``short``), and a one-shot chat demonstration (a previous user / assistant-call /
tool / assistant-answer exchange before the question, ``fewshot``).

    python scripts/probe_tool_calls.py --temperatures 0 0.5 1.0 [-- extra Hydra overrides]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
import tempfile

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
SHORT = 'To multiply, call the calculator: ' + CALL % "A * B"
ONE_SHOT_SYS = ('You have a calculator tool. Call it as <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}'
                '</tool_call>, then answer with the result.')


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["current", "short", "fewshot"])
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    from rlpost.config.compose import compose_config
    from rlpost.envs.tools import parse_tool_calls
    from rlpost.rollout.base import SamplingParams
    from rlpost.run.runner import Run

    cfg = compose_config(["+recipe=agent_multiply_grpo", "logger=jsonl", *a.overrides])
    run = Run(cfg, Path(tempfile.mkdtemp(prefix="probe-")))
    tok, exs = run.tokenizer, run.train_examples[: a.prompts]

    def msgs(variant, e):
        if variant == "fewshot":
            return [{"role": "system", "content": ONE_SHOT_SYS}, {"role": "user", "content": "What is 417 * 2386?"},
                    {"role": "assistant", "content": CALL % "417 * 2386"}, {"role": "tool", "content": "994962"},
                    {"role": "assistant", "content": "994962"}, {"role": "user", "content": e.question}]
        sp = cfg.task.system_prompt if variant == "current" else SHORT
        return [{"role": "system", "content": sp}, {"role": "user", "content": run.task.user_message(e)}]

    try:
        for v in a.variants:
            for T in a.temperatures:
                prompts = [tok.apply_chat_template(msgs(v, e), add_generation_prompt=True, tokenize=True, return_dict=False)
                           for e in exs for _ in range(4)]
                t = time.time()
                g = run.engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=T if T > 0 else 1.0,
                                                                greedy=T == 0, stop=["</tool_call>"], seed=1))
                ok = exact = 0
                for k, txt in enumerate(g.texts):
                    good = [c for c in parse_tool_calls(txt) if c.error is None and c.name == "calculator"]
                    ok += bool(good)
                    want = exs[k // 4].meta["entry"]["metadata"]["expression"].replace(" ", "")
                    exact += bool(good) and str(good[0].arguments.get("expression", "")).replace(" ", "") == want
                print(f"{v:8s} T={T:<4} well-formed {ok}/{len(g.texts)}  exact expression {exact}  {time.time() - t:.0f} s",
                      flush=True)
    finally:
        run.close()


if __name__ == "__main__":
    main()
