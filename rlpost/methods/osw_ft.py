"""OSW-FT's expert trajectories: the step's rollouts were the probes, the update trains on ``o*``.

"Online Self-Weighted Fine-Tuning" (arXiv:2609.00734), Algorithm 1: for each query, ``K`` inference-only
rollouts estimate the success rate ``p_hat``; the loss is the SFT loss of the expert trajectory weighted
by ``1 - p_hat``. Here the ``K = algo.n_samples_per_prompt`` rollouts of a prompt's group are the probes:
they are sampled and scored by the task's verifier as every step's rollouts are, so their correctness
(``batch.extras['reward_correct']``) is what estimator ``osw_ft`` reads. Before the advantages, this
method replaces each row's sampled response by the query's expert trajectory
(:func:`rlpost.algos.osw_ft.expert_trajectory` of the task's worked solution); the rewards are kept.
The loss (tag ``needs_expert_trajectories``) then trains on those tokens only.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from rlpost.algos.inputs import reference_tensors
from rlpost.algos.osw_ft import expert_trajectory
from rlpost.algos.registries import POLICY_LOSSES
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("osw_ft", paper="Online Self-Weighted Fine-Tuning (OSW-FT, arXiv:2609.00734)")
class ExpertTrajectories(Method):
    """Swap the probe rollouts for the expert trajectories (first among the prepare hooks)."""

    name = "osw_ft"
    order = 0

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(POLICY_LOSSES.tag(str(cfg.algo.loss), "needs_expert_trajectories", False))

    def validate(self) -> None:
        """The weight is the ``osw_ft`` estimator's: another estimator's advantages would weight the SFT loss.

        Raises:
            ConfigError: ``algo.adv_estimator`` is not ``osw_ft``.
        """
        adv = str(self.cfg.algo.adv_estimator)
        if adv != "osw_ft":
            raise ConfigError(f"algo.loss={self.cfg.algo.loss} trains on expert trajectories weighted by "
                              f"algo.adv_estimator=osw_ft (1 - the probes' success rate); got adv_estimator={adv}. "
                              f"Fix: algo.adv_estimator=osw_ft (or use algo=osw_ft).")

    def needs(self) -> Needs:
        return Needs(untruncated=True)

    def describe(self) -> str:
        return f"expert trajectories weighted by 1 - p_hat over {int(self.cfg.algo.n_samples_per_prompt)} probes (OSW-FT)"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        """Replace ``batch``'s responses by the expert trajectories of its prompts (in place).

        ``response_ids`` / ``response_mask`` ``[B, R']`` become the tokenised trajectories (+ EOS),
        ``rollout_logprobs`` 0, ``response_texts`` the trajectories; only ``[B]`` extras (the reward
        components) are kept, ``[B, R]`` ones belonged to the sampled tokens. Returns the metrics
        ``osw/p_hat_mean`` (the probes' success rate), ``osw/weight_mean`` and ``osw/signal_lost_frac``
        (share of rows whose every probe succeeded: weight 0), and ``osw/expert_length_mean``.
        """
        from rlpost.algos.osw_ft import CORRECT_KEY, success_weights

        fmt = str(self.cfg.task.answer_format)
        task = run.task
        texts = []
        for i in batch.prompt_index.tolist():
            ex = run.examples[int(i)]
            texts.append(expert_trajectory(task.reference_solution(ex), ex.answer, fmt, task.extract_answer))
        correct = batch.extras.get(CORRECT_KEY, batch.rewards)
        w, p_hat = success_weights(torch.as_tensor(correct).reshape(-1).float(), batch.group_index,
                                   str(self.cfg.algo.adv_params.get("weight", "linear")))
        ids, mask = reference_tensors(texts, run.tokenizer, int(self.cfg.rollout.max_new_tokens))
        batch.response_ids, batch.response_mask = ids, mask
        batch.rollout_logprobs = torch.zeros_like(mask)
        batch.response_texts = texts
        batch.extras = {k: v for k, v in batch.extras.items() if v.dim() == 1}
        return {"osw/p_hat_mean": float(p_hat.mean()), "osw/weight_mean": float(w.mean()),
                "osw/signal_lost_frac": float((w == 0).double().mean()),
                "osw/expert_length_mean": float(mask.sum(-1).mean())}
