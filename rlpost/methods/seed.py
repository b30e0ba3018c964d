"""SEED's hindsight skills: the policy writes a skill per response, then scores the response with it in context.

The loss tagged ``needs_skill="<param>"`` (``seed``, :mod:`rlpost.algos.seed`)
distils from the skill-conditioned self-teacher: its log-probs go to
``batch.extras['teacher_logprobs']`` ``[B, R]``
(:func:`rlpost.algos.seed.batch_skill_logprobs`). The engine's weights (those
that sampled the batch) write the skills.
"""

from __future__ import annotations

from typing import Any, Dict

from rlpost.algos.registries import POLICY_LOSSES
from rlpost.algos.seed import batch_skill_logprobs
from rlpost.algos.validate import loss_kwargs
from rlpost.methods.base import METHODS, Method, Needs, RunServices


def skill_tokens(algo_cfg: Any) -> int:
    """Skill length budget of a loss tagged ``needs_skill="<param>"`` (its parameter of that name), else 0."""
    key = POLICY_LOSSES.tag(str(algo_cfg.loss), "needs_skill", None)
    if not key:
        return 0
    return max(1, int(loss_kwargs(algo_cfg)[key]))


@METHODS.register("seed", paper="SEED: hindsight skills as a self-teacher")
class HindsightSkills(Method):
    """``batch.extras['teacher_logprobs']``: response log-probs with a hindsight skill in context."""

    name = "seed"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "needs_skill", None))

    def needs(self) -> Needs:
        return Needs(provides=("teacher_logprobs",))

    def describe(self) -> str:
        return (f"hindsight skills (up to {skill_tokens(self.cfg.algo)} tokens) and the responses' log-probs "
                f"with them (SEED)")

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        qs = [run.task.user_message(run.examples[int(i)]) for i in batch.prompt_index]
        lp, skills = batch_skill_logprobs(batch, qs, run.engine, run.logprobs, run.tokenizer,
                                          run.sampling_params(run.step), skill_tokens(self.cfg.algo))
        batch.extras["teacher_logprobs"] = lp.float()
        return {"seed/skill_chars_mean": float(sum(len(s) for s in skills) / max(1, len(skills))),
                "seed/skill_empty_frac": float(sum(1 for s in skills if not s) / max(1, len(skills)))}
