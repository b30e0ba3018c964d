"""T^5's gate and learned mixing of the twin critics' advantages (``algo=t5``).

Paper: "T^5: Twin-Critic Training for Token-Level Thoughts in Reinforcement Mid-Training"
(arXiv:2609.32791; abstract only, so the rules here are our reading, see :mod:`rlpost.algos.t5`).

Per step, in the ``advantages`` stage after the ``t5`` estimator (hook ``after_advantages``):

1. warm-up (``step <= algo.critic.warmup_steps``): the policy is frozen by the run (the critics train);
   nothing is mixed;
2. qualification: every critic's explained variance of the Monte-Carlo returns on this step's batch,
   whose values the critic computed before training on it (held out), must reach
   ``qualification_threshold``; once reached the gate stays open (saved with the checkpoint). Until
   then the estimator's fallback (the return minus its batch mean) is the advantage;
3. qualified: ``saddle_steps`` simultaneous descent-ascent steps of the mixer and the prefix test
   function on the batch, then ``extras['advantages']`` = the mix ``sum_k w_k(s_t, a_t) A^k``.

State (mixer, test function, gate) is this method's ``state_dict``; both critics are the trainer's
critic (one backbone, ``algo.critic.num_heads`` heads), saved in ``trainer.pt``.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.t5 import (PAPER, TwinMixer, explained_variance, mixed_advantages, mixer_features,
                             prefix_features, run_saddle)
from rlpost.algos.validate import adv_overrides
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices


@METHODS.register("t5", paper=PAPER)
class TwinCriticMixing(Method):
    """T^5's warm-up / qualification gate and the conditional-moment saddle-point mixing of N critics.

    Raises (``validate``):
        ConfigError: ``algo.critic.num_heads`` differs from ``len(algo.adv_params.lams)`` or is below 2,
        or a parameter is out of range.
    """

    name = "t5"
    paper = PAPER

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.p = dict(ADV_ESTIMATORS.kwargs("t5", adv_overrides(cfg.algo), "algo.adv_params"))
        self.n = len(self.p["lams"])
        self.mix = TwinMixer(max(2, self.n), int(self.p["mixer_hidden"]), seed=int(cfg.get("seed", 0) or 0))
        self.qualified = False
        self.qualified_at = -1

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.algo.adv_estimator) == "t5"

    def validate(self) -> None:
        heads = int(self.cfg.algo.critic.get("num_heads", 1) or 1)
        if self.n < 2:
            raise ConfigError(f"algo.adv_params.lams={list(self.p['lams'])}: T^5 mixes at least two critics; "
                              "give one GAE lambda per critic, e.g. [1.0, 0.95].")
        if heads != self.n:
            raise ConfigError(f"algo=t5 has {self.n} critics (algo.adv_params.lams) but algo.critic.num_heads={heads}. "
                              f"Fix: algo.critic.num_heads={self.n}.")
        if int(self.p["saddle_steps"]) < 0 or float(self.p["mixer_lr"]) <= 0 or int(self.p["mixer_hidden"]) < 0:
            raise ConfigError("algo.adv_params: saddle_steps and mixer_hidden must be >= 0 and mixer_lr > 0 "
                              f"(got {self.p['saddle_steps']}, {self.p['mixer_hidden']}, {self.p['mixer_lr']}).")
        if float(self.p["signal_retention_coef"]) < 0:
            raise ConfigError(f"algo.adv_params.signal_retention_coef={self.p['signal_retention_coef']} must be >= 0 "
                              "(0 switches the signal-retention constraint off).")

    def needs(self) -> Needs:
        return Needs(old_logprobs=True)  # the mixer's action feature: log pi_old(a_t | s_t)

    def describe(self) -> str:
        return f"T^5: {self.n} critics, held-out qualification, saddle-point mixing (after the estimator)"

    def after_advantages(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        return self.mix_batch(batch, int(run.step))

    def mix_batch(self, batch: Any, step: int) -> Dict[str, Any]:
        """Gate, saddle steps and the mixed advantages of ``batch`` at RL step ``step``; returns metrics.

        Reads ``extras['t5_head_advantages']`` ``[B, R, N]``, ``t5_mc_returns`` ``[B, R]``, ``values``
        ``[B, R, N]`` and ``old_logprobs`` ``[B, R]``; writes ``extras['advantages']`` once qualified.
        """
        if step <= int(self.cfg.algo.critic.warmup_steps):
            return {"t5/phase": 0.0}
        m = batch.response_mask.float()
        head_adv = batch.extras["t5_head_advantages"].float()
        values = batch.extras["values"]
        out: Dict[str, Any] = {}
        if not self.qualified:
            vals = values if values.dim() == 3 else values.unsqueeze(-1).expand_as(head_adv)
            evs = [explained_variance(batch.extras["t5_mc_returns"], vals[..., k], m) for k in range(self.n)]
            out.update({f"t5/explained_var_critic{k}": ev for k, ev in enumerate(evs)})
            if all(ev == ev and ev >= float(self.p["qualification_threshold"]) for ev in evs):
                self.qualified, self.qualified_at = True, int(step)
        out["t5/qualified"] = float(self.qualified)
        if not self.qualified:
            out["t5/phase"] = 1.0
            return out
        x = mixer_features(head_adv, values, batch.extras["old_logprobs"], m)
        z = prefix_features(values, m, self.n)
        met = run_saddle(self.mix, x, z, head_adv, m, int(self.p["saddle_steps"]), float(self.p["mixer_lr"]),
                         float(self.p["retention_target"]), float(self.p["signal_retention_coef"]))
        adv, w = mixed_advantages(self.mix, x, head_adv, m, bool(self.p["whiten"]))
        batch.extras["advantages"] = adv
        out["t5/phase"] = 2.0
        out["t5/weight_critic0_mean"] = float((w[..., 0] * m).sum() / m.sum().clamp(min=1))
        if met is not None:
            out.update({f"t5/{k}": v for k, v in met.items()})
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"mixer": {k: v.clone() for k, v in self.mix.state_dict().items()},
                "qualified": self.qualified, "qualified_at": self.qualified_at}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if sd.get("mixer"):
            self.mix.load_state_dict({k: torch.as_tensor(v) for k, v in sd["mixer"].items()})
        self.qualified = bool(sd.get("qualified", False))
        self.qualified_at = int(sd.get("qualified_at", -1))
