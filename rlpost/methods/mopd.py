"""Open-MOPD's domain labels: each row's domain index and target share, for the ``mopd`` estimator.

"Open-MOPD: Diagnosing and Fixing Capability Imbalance in Multi-Teacher On-Policy
Distillation" (arXiv:2608.19098; code https://github.com/BytedTsinghua-SIA/Open-MOPD).
The routing itself is the generic multi-teacher stage (``model.teachers``:
:class:`rlpost.models.teacher.RoutedTeacher`); the budget weights and the reward refresh
are tensor functions in :mod:`rlpost.algos.mopd`. This method gives the estimator what
it cannot read from tensors alone: the domain of each row (its prompt's
``example.meta['domain']``, the same label that routes it to its teacher) as an index
into the sorted ``model.teachers`` keys, and that domain's target share ``g*_d``
(``algo.adv_params.target_shares``, equal by default).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from rlpost.algos.mopd import DOMAIN_ID, DOMAIN_TARGET
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.algos.validate import adv_overrides
from rlpost.core.errors import ConfigError
from rlpost.methods.base import METHODS, Method, Needs, RunServices
from rlpost.tasks.base import example_domain

_PAPER = "Open-MOPD (arXiv:2608.19098)"


@METHODS.register("mopd", paper=_PAPER)
class DomainLabels(Method):
    """Write ``extras['domain_id']`` ``[B]`` long and ``extras['domain_target']`` ``[B]`` float before the update.

    Raises (``validate``):
        ConfigError: ``algo.adv_estimator=mopd`` without ``model.teachers``; ``target_shares``
            that miss a domain of ``model.teachers``, name another one, or are negative / all zero.
    """

    name = "mopd"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return str(cfg.algo.adv_estimator) == "mopd"

    def _domains(self) -> List[str]:
        return sorted(str(d) for d in (self.cfg.model.get("teachers", None) or {}))

    def _targets(self) -> Dict[str, float]:
        kw = ADV_ESTIMATORS.kwargs("mopd", adv_overrides(self.cfg.algo), "algo.adv_params")
        shares = kw["target_shares"]
        return {d: 1.0 for d in self._domains()} if shares is None else {str(k): float(v) for k, v in dict(shares).items()}

    def validate(self) -> None:
        domains = self._domains()
        if not domains:
            raise ConfigError("algo.adv_estimator=mopd routes each prompt to its domain's teacher, but model.teachers "
                              "is not set. Fix: model.teachers.<domain>=<model preset or HF dir>, one per domain of the "
                              "task (e.g. task=arithmetic_mix has basic_arithmetic and chain_sum).")
        t = self._targets()
        if set(t) != set(domains):
            raise ConfigError(f"algo.adv_params.target_shares names {sorted(t)} but model.teachers has the domains "
                              f"{domains}. Fix: one share per domain of model.teachers, or null for equal shares.")
        if any(v < 0 for v in t.values()) or sum(t.values()) <= 0:
            raise ConfigError(f"algo.adv_params.target_shares={t}: shares must be >= 0 and not all 0.")

    def needs(self) -> Needs:
        return Needs(provides=(DOMAIN_ID, DOMAIN_TARGET))

    def describe(self) -> str:
        return "each row's domain (routing label) and target token share"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        """Domain index and target share of each row; logs each domain's prompt and response-token shares.

        Raises:
            ConfigError: a row whose domain has no teacher in ``model.teachers``.
        """
        domains, targets = self._domains(), self._targets()
        pos = {d: k for k, d in enumerate(domains)}
        labels = [example_domain(run.examples[int(i)]) for i in batch.prompt_index.tolist()]
        bad = sorted(set(labels) - set(pos))
        if bad:
            raise ConfigError(f"prompts of domain(s) {bad} have no teacher in model.teachers ({domains}). "
                              f"Fix: model.teachers.{bad[0]}=<model preset or HF dir>.")
        ids = torch.tensor([pos[d] for d in labels], dtype=torch.long)
        batch.extras[DOMAIN_ID] = ids
        batch.extras[DOMAIN_TARGET] = torch.tensor([targets[d] for d in labels], dtype=torch.float32)
        n = batch.response_mask.sum(-1).float()
        total = float(n.sum().clamp(min=1))
        metrics: Dict[str, Any] = {}
        for d, k in pos.items():
            rows = ids == k
            metrics[f"mopd/{d}/prompt_share"] = float(rows.float().mean()) if len(ids) else 0.0
            metrics[f"mopd/{d}/token_share"] = float(n[rows].sum()) / total
        return metrics
