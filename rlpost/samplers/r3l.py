"""``sampler=r3l``: reflect on a failed attempt, then retry it from the step the reflection names.

"R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided
Exploration, Pivotal Credit, and Positive Amplification" (arXiv:2601.03715;
authors' code https://github.com/shiweijiezero/R3L). Instead of sampling a
prompt again from scratch, R^3L asks the policy to diagnose a failed attempt in
language and to name the step where it went wrong; the attempt's steps before
that point are kept and the rest is regenerated with the diagnosis in context.
The update side (shared prefix masked, Positive Amplification) is
``algo=r3l`` (:mod:`rlpost.algos.r3l`).

Only the abstract was readable; the procedure follows the authors' code
(``R3L_dapo_workflow`` / ``R3L_countdown_workflow``, their reasoning tasks):

* **Budget.** Of a prompt's ``n`` rollouts, ``floor(n * first_fraction)`` (at
  least 1) are first attempts (the release: ``n // 2``); each failed one may add
  one retried row to the same group, so a group holds at most ``2 * floor(n / 2)``
  rows (fewer when some attempts succeed or a reflection cannot be used).
* **Reflector = the policy itself** (the release calls the same model). Its
  prompt (``reflection_prompt``, our wording; the release asks for a JSON report
  with a ``retry_from_step`` field) shows the problem and the attempt split into
  numbered steps (``Step 0``, ``Step 1``, ...; segmentation rule ``segment``)
  and asks for the step to retry from.
* **Failure point.** :func:`parse_failure_step`: the last match of
  ``step_pattern`` in the reflection (it reads both our ``Retry from step: k``
  line and the release's ``"retry_from_step": k``); valid when
  ``0 <= k < number of steps`` (the release's check), otherwise the attempt is not
  retried (counted).
* **Restart.** :func:`restart_prefix`: the retry keeps steps ``0 .. k-1`` of the
  attempt (its response tokens up to step ``k-1``'s last token; ``k = 0`` restarts
  from scratch) and the policy continues it under a prompt whose question carries
  the reflection (``guidance_template``, our wording; the release appends its
  self-correction template to the system prompt, or for a multi-turn retry puts
  it as a message just before the retried turn). Prefix continuation is SCOPE's
  :func:`rlpost.samplers.scope.regenerate_suffix`.
* **What is trained.** The retried row is stored under the original prompt, the
  reflection removed (the release's ``distill_trajectory``): kept prefix +
  continuation, the continuation's rollout log-probs those of the guided context.
  ``extras['r3l_prefix_len']`` holds the shared prefix length of the retried row
  *and* of its source attempt (``mask_source``: the release masks both "for fair
  comparison"), ``extras['r3l_retried']`` flags retried rows; ``algo=r3l`` reads them.
* ``max_retries`` (release: 1): a retry that fails again is reflected upon and
  retried again, up to that many rounds; the group keeps the last retry of each
  attempt.

Not followed (our choices): only attempts with reward ``< fail_below`` are
reflected upon (the release also reflects on successes and retries those its
reflector calls "success_but_inefficient"); the release's extra reward-1 rows
(the reflection text, the retry under the guided prompt) are not added.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.algos.r3l import PREFIX_KEY, RETRIED_KEY
from rlpost.core.registry import param
from rlpost.samplers.base import (
    SAMPLERS,
    SampleResult,
    Sampler,
    generate_groups,
    merge_results,
    pad_id_of,
    score_rows,
    step_params,
)
from rlpost.samplers.scope import regenerate_suffix, take_rows
from rlpost.tasks.chat import encode_framed, template_parts
from rlpost.tasks.steps import policy_step_positions, segment_steps

PAPER = ("R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided Exploration, Pivotal Credit, "
         "and Positive Amplification (arXiv:2601.03715)")

REFLECTION_PROMPT = (
    "The attempt below at this problem is wrong.\n\nProblem: {question}\n\nAttempt, in steps:\n{steps}\n\n"
    "Say which step first goes wrong and why. End with one line: Retry from step: N (N from 0 to {last}).")
GUIDANCE_TEMPLATE = ("{question}\n\nA review of an earlier wrong attempt at this problem:\n{reflection}\n"
                     "Use what it says; do not mention it.")
STEP_PATTERN = r"(?i)retry[ _]from[ _]step\"?\s*[:=]?\s*(\d+)"


@dataclass(frozen=True)
class R3LSamplerParams:
    """R^3L's reflect-then-retry (arXiv:2601.03715); defaults from the authors' code where it has one."""

    first_fraction: float = param(0.5, "share of a prompt's rollouts drawn as first attempts; each failed one may "
                                  "add one retry (release: n // 2)")
    max_retries: int = param(1, "reflect-then-retry rounds per failed attempt (release: 1)")
    fail_below: float = param(1.0, "an attempt with reward below this has failed and is reflected upon")
    segment: str = param("newline", "step segmentation rule of the attempts (rlpost list step_segment)")
    reflection_prompt: str = param(REFLECTION_PROMPT, "the reflector's prompt (our wording): {question}, {steps} "
                                   "(numbered 'Step k: ...' lines), {last} (the last step's number)")
    guidance_template: str = param(GUIDANCE_TEMPLATE, "the retry's question (our wording): {question}, "
                                   "{reflection}")
    step_pattern: str = param(STEP_PATTERN, "regex whose group 1 is the failure step in a reflection (last match)")
    max_reflection_tokens: int = param(96, "new tokens of a reflection (our CPU budget; the release allows 4096)")
    mask_source: bool = param(True, "also mark the source attempt's shared prefix (release: masked, for fair "
                              "comparison)")


def first_count(c: int, fraction: float) -> int:
    """First attempts among ``c`` rollouts: ``floor(c * fraction)``, at least 1 (0 when ``c == 0``)."""
    return 0 if c <= 0 else max(1, int(math.floor(c * fraction + 1e-9)))


def numbered_steps(text: str, spans: Sequence[Tuple[int, int]]) -> str:
    """``"Step 0: <step 0>\\nStep 1: <step 1>..."`` for the reflector (0-based, as the release numbers them)."""
    return "\n".join(f"Step {k}: {text[a:b]}" for k, (a, b) in enumerate(spans))


def parse_failure_step(reflection: str, pattern: str, num_steps: int) -> Optional[int]:
    """The failure step ``k`` named by ``reflection``: group 1 of the last match of ``pattern``, or None when
    there is no match or ``k`` is outside ``[0, num_steps)``."""
    found = re.findall(pattern, reflection or "")
    if not found:
        return None
    k = int(found[-1] if isinstance(found[-1], str) else found[-1][0])
    return k if 0 <= k < num_steps else None


def restart_prefix(tokenizer: Any, text: str, spans: Sequence[Tuple[int, int]], k: int, n_tokens: int
                   ) -> Optional[int]:
    """Response tokens kept when retrying from step ``k``: 0 for ``k = 0``; else the position after step
    ``k - 1``'s last token (the policy tokenizer's offsets), None when that is the whole response."""
    if k <= 0:
        return 0
    pos = policy_step_positions(tokenizer, text, spans[:k])
    cut = min(int(pos[k - 1]) + 1, int(n_tokens))
    return cut if 0 < cut < n_tokens else None


@SAMPLERS.register("r3l", paper=PAPER, params=R3LSamplerParams,
                   description="R^3L: the policy reflects on failed attempts; retried from the failure step.")
class R3LSampler(Sampler):
    """R^3L's reflect-then-retry (module docstring).

    One step: first attempts (one engine call), scored; for each failed one the
    policy writes a reflection (one call for all), the failure step is parsed and
    the attempt continued from there under the guided prompt (one call), scored.
    Rows: the first attempts, then the retries (group of their source attempt).
    ``rollouts_spent`` counts attempts and retries (reflections are in
    ``sampler/r3l_reflections``).

    Metrics: ``sampler/r3l_failed``, ``r3l_reflections``, ``r3l_unparsed``
    (no valid step named), ``r3l_retried``, ``r3l_retry_solved``,
    ``r3l_prefix_tokens_mean``, ``r3l_restart_step_mean``.

    Raises:
        ValueError: (construction) bad fractions or counts, a template without its
            fields, a pattern without a group; the build wraps it in a ConfigError
            naming ``sampler.params``.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, first_fraction: float, max_retries: int, fail_below: float, segment: str,
                 reflection_prompt: str, guidance_template: str, step_pattern: str, max_reflection_tokens: int,
                 mask_source: bool) -> None:
        super().__init__(n_samples)
        if not 0.0 < float(first_fraction) <= 1.0:
            raise ValueError(f"first_fraction={first_fraction} must be in (0, 1] (release: 0.5)")
        if int(max_retries) < 1:
            raise ValueError(f"max_retries={max_retries} must be >= 1 (release: 1)")
        if int(max_reflection_tokens) < 1:
            raise ValueError(f"max_reflection_tokens={max_reflection_tokens} must be >= 1")
        for name, text, fields in (("reflection_prompt", reflection_prompt, ("{question}", "{steps}")),
                                   ("guidance_template", guidance_template, ("{question}", "{reflection}"))):
            missing = [f for f in fields if f not in text]
            if missing:
                raise ValueError(f"{name} needs the fields {', '.join(missing)} (e.g. the default: {name}=null)")
        try:
            groups = re.compile(step_pattern).groups
        except re.error as e:
            raise ValueError(f"step_pattern={step_pattern!r} is not a regex ({e})") from None
        if groups < 1:
            raise ValueError(f"step_pattern={step_pattern!r} needs a group (the step number), e.g. {STEP_PATTERN!r}")
        segment_steps("", str(segment))  # an unknown rule is a ConfigError now, not at the first failure
        self.first_fraction, self.max_retries, self.fail_below = float(first_fraction), int(max_retries), float(fail_below)
        self.segment, self.reflection_prompt, self.guidance_template = str(segment), str(reflection_prompt), str(guidance_template)
        self.step_pattern, self.max_reflection_tokens = str(step_pattern), int(max_reflection_tokens)
        self.mask_source = bool(mask_source)
        self.task: Any = None
        self.examples: Optional[List[Any]] = None

    def attach(self, task: Any = None, examples: Optional[List[Any]] = None, run_dir: Any = None) -> None:
        """The run's task and training examples (the reflection and the retry render each prompt's question)."""
        self.task, self.examples = task, examples

    # ------------------------------------------------------------ prompts
    def _question(self, engine: Any, prompt: List[int], pos: int, ctx: Any) -> Tuple[str, Any]:
        """``(question text, example or None)`` of prompt position ``pos``."""
        if self.examples is not None and ctx.prompt_indices is not None:
            ex = self.examples[int(ctx.prompt_indices[pos])]
            return str(ex.question), ex
        return engine.tokenizer.decode(prompt, skip_special_tokens=True), None

    def reflection_ids(self, tokenizer: Any, question: str, text: str, spans: Sequence[Tuple[int, int]]) -> List[int]:
        """Token ids of the reflector's prompt (one user turn through the chat template when there is one)."""
        body = self.reflection_prompt.format(question=question, steps=numbered_steps(text, spans),
                                             last=max(0, len(spans) - 1))
        if getattr(tokenizer, "chat_template", None):
            return list(encode_framed(tokenizer, *template_parts(tokenizer, [{"role": "user", "content": body}], True)))
        return list(tokenizer(body, add_special_tokens=False)["input_ids"])

    def guided_prompt(self, engine: Any, prompt: List[int], question: str, example: Any, reflection: str) -> List[int]:
        """Token ids the retry continues under: the task renders the example with ``guidance_template`` as its
        question (ids the driver put after the plain rendering, a hint, follow it); without a task, the guidance
        text's ids go in front of the prompt's."""
        text = self.guidance_template.format(question=question, reflection=reflection.strip())
        if self.task is not None and example is not None:
            ids = list(self.task.render_prompt(dataclasses.replace(example, question=text), engine.tokenizer))
            plain = list(self.task.render_prompt(example, engine.tokenizer))
            tail = list(prompt)[len(plain):] if list(prompt)[: len(plain)] == plain else []
            return ids + tail
        block = self.guidance_template.format(question="", reflection=reflection.strip())
        return list(engine.tokenizer(block, add_special_tokens=False)["input_ids"]) + list(prompt)

    # ------------------------------------------------------------ sampling
    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        firsts = [first_count(c, self.first_fraction) for c in self.counts(len(prompts), ctx)]
        pos1 = [i for i, n in enumerate(firsts) if n > 0]
        res = generate_groups(engine, [prompts[i] for i in pos1], [firsts[i] for i in pos1],
                              step_params(params, ctx, 0), positions=pos1)
        score_rows(ctx, res)
        B = len(res.group_index)
        prefix = torch.zeros(B, dtype=torch.long)
        res.extras[RETRIED_KEY] = torch.zeros(B)
        failed = [i for i, r in enumerate(res.rewards.tolist()) if r < self.fail_below]
        m = {"sampler/r3l_failed": float(len(failed)), "sampler/r3l_reflections": 0.0, "sampler/r3l_unparsed": 0.0,
             "sampler/r3l_retried": 0.0}
        pos = res.positions().tolist()
        tok = engine.tokenizer
        questions: Dict[int, Tuple[str, Any]] = {}
        cur_gen, cur_rows, src = res.generation, list(failed), {i: i for i in failed}
        last: Dict[int, Tuple[SampleResult, int, int]] = {}  # source row -> (retry part, its row, prefix kept)
        restart_steps: List[int] = []
        call, generated = 1, 0
        for rnd in range(self.max_retries):
            if not cur_rows:
                break
            texts = [cur_gen.texts[i] for i in cur_rows]
            spans = [segment_steps(t, self.segment) for t in texts]
            qs = [questions.setdefault(int(pos[src[i]]), self._question(engine, prompts[int(pos[src[i]])],
                                                                        int(pos[src[i]]), ctx)) for i in cur_rows]
            refl = engine.generate([self.reflection_ids(tok, q[0], t, sp) for q, t, sp in zip(qs, texts, spans)],
                                   replace(step_params(params, ctx, call), max_new_tokens=self.max_reflection_tokens))
            call += 1
            m["sampler/r3l_reflections"] += len(cur_rows)
            keep: Dict[int, int] = {}
            bases: Dict[int, List[int]] = {}
            for j, i in enumerate(cur_rows):
                k = parse_failure_step(refl.texts[j], self.step_pattern, len(spans[j]))
                cut = None if k is None else restart_prefix(tok, texts[j], spans[j], k,
                                                           int(cur_gen.response_mask[i].sum()))
                if cut is None:
                    m["sampler/r3l_unparsed"] += 1
                    continue
                keep[i] = cut
                restart_steps.append(int(k))
                p = int(pos[src[i]])
                bases[i] = self.guided_prompt(engine, prompts[p], qs[j][0], qs[j][1], refl.texts[j])
            rows = sorted(keep)
            if not rows:
                break
            gen = regenerate_suffix(engine, [bases[i] for i in rows], cur_gen, rows, [keep[i] for i in rows],
                                    step_params(params, ctx, call), int(params.max_new_tokens), pad_id_of(engine))
            call += 1
            generated += len(rows)
            srcs = torch.tensor([src[i] for i in rows])
            part = SampleResult(generation=gen, group_index=res.group_index[srcs], rollouts_spent=len(rows),
                                prompt_position=None if res.prompt_position is None else res.prompt_position[srcs])
            score_rows(ctx, part)
            for j, i in enumerate(rows):
                if rnd == 0 and self.mask_source:
                    prefix[src[i]] = keep[i]
                last[src[i]] = (part, j, keep[i])
            cur_gen = gen
            nxt = [j for j in range(len(rows)) if float(part.rewards[j]) < self.fail_below]
            src = {j: src[rows[j]] for j in nxt}
            cur_rows = nxt
        res.extras[PREFIX_KEY] = prefix
        if not last:
            res.metrics = m
            return res
        picks = []
        for s in sorted(last):
            part, j, n = last[s]
            one = take_rows(part, [j])
            one.extras[PREFIX_KEY] = torch.tensor([n], dtype=torch.long)
            one.extras[RETRIED_KEY] = torch.ones(1)
            picks.append(one)
        out = merge_results([res] + picks, pad_id_of(engine))
        out.rollouts_spent = res.rollouts_spent + generated
        retry_r = torch.cat([p.rewards for p in picks])
        m.update({"sampler/r3l_retried": float(len(picks)),
                  "sampler/r3l_retry_solved": float((retry_r >= self.fail_below).float().mean()),
                  "sampler/r3l_prefix_tokens_mean": float(sum(v[2] for v in last.values()) / len(last)),
                  "sampler/r3l_restart_step_mean": float(sum(restart_steps) / max(1, len(restart_steps)))})
        out.metrics = m
        return out
