"""SEED-GRPO's semantic clusters: the cluster id of each response's extracted final answer.

"SEED-GRPO: Semantic Entropy Enhanced GRPO for Uncertainty-Aware Policy
Optimization" (arXiv:2505.12346). Estimators tagged ``needs_answers`` read
``batch.extras['answer_ids']`` ``[B]`` (:func:`answer_cluster_ids`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.methods.base import METHODS, Method, Needs, RunServices
from rlpost.tasks.answer_tags import extract_answer


def normalise_answer(answer: Optional[str]) -> Optional[str]:
    """Canonical form of an extracted answer for clustering: numbers by value, text by its words, lower case.

    ``"12"``, ``"12.0"`` and ``" 12 "`` are one answer; None and ``""`` stay None.
    """
    if answer is None:
        return None
    a = " ".join(str(answer).strip().split()).lower().rstrip(".")
    if not a:
        return None
    try:
        v = float(a.replace(",", ""))
        return repr(int(v)) if v.is_integer() else repr(v)
    except ValueError:
        return a


def answer_cluster_ids(texts: List[str], answer_format: str) -> torch.Tensor:
    """``[B]`` long cluster ids of the responses' final answers (SEED-GRPO's semantic clusters).

    Answers are extracted by the task's ``answer_format``
    (:func:`rlpost.tasks.answer_tags.extract_answer`) and compared after
    :func:`normalise_answer`; a response with no extractable answer is a
    cluster of its own (negative id). Ids are only compared within a group.
    """
    ids: Dict[str, int] = {}
    out = []
    for i, t in enumerate(texts):
        a = normalise_answer(extract_answer(t, answer_format))
        out.append(-(i + 1) if a is None else ids.setdefault(a, len(ids)))
    return torch.tensor(out, dtype=torch.long)


@METHODS.register("seed_grpo", paper="SEED-GRPO (arXiv:2505.12346)")
class AnswerClusters(Method):
    """Cluster the responses by their final answer (task's ``answer_format``)."""

    name = "seed_grpo"

    @classmethod
    def applies(cls, cfg: Any) -> bool:
        return bool(ADV_ESTIMATORS.tag(str(cfg.algo.adv_estimator), "needs_answers", False))

    def needs(self) -> Needs:
        return Needs(provides=("answer_ids",))

    def describe(self) -> str:
        return "answer clusters"

    def prepare(self, batch: Any, run: RunServices) -> Dict[str, Any]:
        ids = answer_cluster_ids(list(batch.response_texts), str(self.cfg.task.answer_format))
        batch.extras["answer_ids"] = ids
        return {"adv/answer_clusters_mean": float(len(set(ids.tolist())) / max(1, len(set(batch.group_index.tolist()))))}
