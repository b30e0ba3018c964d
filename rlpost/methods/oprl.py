"""OPRL's implicit PRM: a copy of the policy trained online by trajectory DPO; its step rewards for the estimator.

"Online Process Reward Learning for Agentic Reinforcement Learning" (OPRL,
arXiv:2509.19199; :mod:`rlpost.algos.oprl`). Each step, in the ``algo_inputs``
stage: the pre-update policy's log-probs of the responses (no grad), the PRM's
DPO update on the group's outcome preference pairs (``prm_updates`` Adam
steps), then the updated PRM's log-probs (no grad) give each step's implicit
reward ``beta sum (log pi_phi - log pi_old)``. The estimator tagged
``needs_implicit_prm`` (``oprl``) reads ``batch.extras['oprl_step_rewards']``
and ``['oprl_segment']`` ``[B, R]``. The PRM's weights and optimizer are saved
with every checkpoint.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch

from rlpost.algos.oprl import dpo_loss, preference_pairs, step_rewards
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides
from rlpost.algos.vps import step_token_ends
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices
from rlpost.tasks.steps import SEGMENTERS


def token_segments(batch: Any, tokenizer: Any, rule: str) -> Tuple[torch.Tensor, int]:
    """``([B, R] long step number of each response token (1-based, 0 outside every step), rows without a step)``.

    Step ``k`` covers the tokens after step ``k - 1``'s last token up to its own
    (:func:`rlpost.algos.vps.step_token_ends`, the shared segmentation rule).
    """

    B, R = batch.response_ids.shape
    seg = torch.zeros(B, R, dtype=torch.long)
    none = 0
    for i, n in enumerate(batch.response_mask.sum(-1).long().tolist()):
        ends = step_token_ends(tokenizer, batch.response_texts[i], rule, int(n)) if n else []
        if not ends:
            none += 1
        prev = -1
        for k, e in enumerate(ends, start=1):
            seg[i, prev + 1:e + 1] = k
            prev = e
    return seg * (batch.response_mask > 0), none


@METHODS.register("oprl", paper="OPRL (arXiv:2509.19199)")
class ImplicitPRM(Method):
    """The implicit PRM (a trainable copy of the policy) and its per-step DPO update.

    Raises:
        ConfigError: (``validate``) an unknown segmentation rule, ``beta <= 0``,
            ``prm_lr < 0``, ``prm_updates < 0``; (``prepare``) no response of the
            batch has a step.
    """

    name = "oprl"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        adv = str(cfg.algo.adv_estimator)
        self.params = dict(ADV_ESTIMATORS.kwargs(adv, adv_overrides(cfg.algo), "algo.adv_params"))
        self.prm: Optional[torch.nn.Module] = None
        self.opt: Optional[torch.optim.Optimizer] = None
        self._pending: Optional[Dict[str, Any]] = None

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_implicit_prm", False))

    def validate(self) -> None:

        p = self.params
        try:
            SEGMENTERS.entry(str(p["segment"]))
        except ConfigError as e:
            raise ConfigError(f"algo.adv_params.segment: {e}") from None
        if float(p["beta"]) <= 0:
            raise ConfigError(f"algo.adv_params.beta={p['beta']} must be > 0 (the DPO temperature). Fix: e.g. 0.05.")
        if float(p["prm_lr"]) < 0 or int(p["prm_updates"]) < 0:
            raise ConfigError(f"algo.adv_params.prm_lr={p['prm_lr']} and prm_updates={p['prm_updates']} must be >= 0 "
                              f"(0 freezes the implicit PRM at the initial policy).")
        if float(p["step_weight"]) < 0:
            raise ConfigError(f"algo.adv_params.step_weight={p['step_weight']} must be >= 0 (0 is GRPO).")

    def needs(self) -> Needs:
        return Needs(provides=("oprl_step_rewards", "oprl_segment"))

    def describe(self) -> str:
        return "implicit PRM: trajectory-DPO update, then step rewards (OPRL)"

    def setup(self, run: RunServices) -> None:
        self.prm = copy.deepcopy(run.policy)
        self.prm.eval()
        for q in self.prm.parameters():
            q.requires_grad_(True)
        self.opt = torch.optim.Adam([q for q in self.prm.parameters() if q.is_floating_point()],
                                    lr=float(self.params["prm_lr"]), betas=(0.9, 0.999))
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def _seq_logprobs(self, fwd: Any, model: torch.nn.Module, batch: Any, rows: int, grad_of: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
        """``[B, R]`` log-probs under ``model`` in chunks of ``rows``; with ``grad_of`` ``[B]`` also backpropagates
        ``sum_i grad_of_i * (sum_t log pi(y_it))`` chunk by chunk (the DPO gradient, exact)."""
        B, R = batch.response_ids.shape
        out = torch.zeros(B, R)
        for a in range(0, B, rows):
            idx = list(range(a, min(B, a + rows)))
            mb = batch.select(idx)
            if grad_of is None:
                with torch.no_grad():
                    lp = fwd.logprobs(model, mb, False, False)[0]
            else:
                lp = fwd.logprobs(model, mb, False, False)[0]
                s = (lp.float() * mb.response_mask.to(lp.device)).sum(-1)
                (s * grad_of[idx].to(s.device)).sum().backward()
            out[idx, :lp.shape[1]] = lp.detach().float().cpu()
        return out * batch.response_mask

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:

        if self.prm is None:
            self.setup(run)
        p = self.params
        seg, none = token_segments(batch, run.tokenizer, str(p["segment"]))
        if len(batch) and none == len(batch):
            raise ConfigError(
                f"oprl: segmentation rule algo.adv_params.segment={p['segment']!r} found no steps in any of the "
                f"{len(batch)} responses of step {run.step} (e.g. {batch.response_texts[0][:60]!r}), so the implicit "
                f"PRM gives no step reward. Fix: algo.adv_params.segment=newline or sentence, or a prompt "
                f"(task.system_prompt) that asks for that step format.")
        fwd = run.forward_pass()
        rows = max(1, int(self.cfg.trainer.micro_batch_size))
        lp_old = run.logprobs(batch)[0] * batch.response_mask
        s_old = lp_old.double().sum(-1)
        pairs = preference_pairs(batch.rewards, batch.group_index)
        losses: List[float] = []
        for _ in range(int(p["prm_updates"]) if pairs else 0):
            lp_phi = self._seq_logprobs(fwd, self.prm, batch, rows)
            s_phi = lp_phi.double().sum(-1).requires_grad_(True)
            loss = dpo_loss(s_phi, s_old, pairs, float(p["beta"]))
            loss.backward()
            self.opt.zero_grad(set_to_none=True)
            self._seq_logprobs(fwd, self.prm, batch, rows, grad_of=s_phi.grad.float())
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        lp_phi = self._seq_logprobs(fwd, self.prm, batch, rows)
        sr = step_rewards(lp_phi, lp_old, seg, float(p["beta"]))
        batch.extras["oprl_step_rewards"], batch.extras["oprl_segment"] = sr, seg
        n_steps = sum(len(set(x for x in seg[i].tolist() if x > 0)) for i in range(len(batch)))
        firsts = [float(sr[i][seg[i] == k][0]) for i in range(len(batch)) for k in set(seg[i].tolist()) if k > 0]
        return {"adv/oprl_pairs": float(len(pairs)), "adv/oprl_dpo_loss": losses[0] if losses else 0.0,
                "adv/oprl_steps_per_row": n_steps / max(1, len(batch) - none), "adv/oprl_no_step_rows": float(none),
                "adv/oprl_step_reward_abs_mean": sum(abs(x) for x in firsts) / max(1, len(firsts))}

    def state_dict(self) -> Dict[str, Any]:
        if self.prm is None:
            return {}
        return {"prm": {k: v.detach().cpu().clone() for k, v in self.prm.state_dict().items()},
                "opt": self.opt.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if not sd.get("prm"):
            return
        if self.prm is None:
            self._pending = sd
            return
        self.prm.load_state_dict(sd["prm"])
        if sd.get("opt"):
            self.opt.load_state_dict(sd["opt"])
        self._pending = None
