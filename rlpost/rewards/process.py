"""Process rewards: step segmentation (one declared rule, shared) and the PRM verifier.

A response is cut into steps by a registered rule (:data:`SEGMENTERS`:
``newline``, ``step_k``, ``sentence``); every method that needs steps calls
:func:`segment_steps`. The PRM verifier (``task.reward.models.<name>.kind=prm``)
scores each step with a local classification model and puts the score on the
step's **last token** as a token reward: ``Rewards.token_rewards`` ->
``extras['turn_rewards']`` ``[B, R]`` (:func:`place_token_rewards`), which the
runner adds to the advantage estimator's token rewards, the path multi-turn
per-turn rewards already take. Only estimators tagged ``uses_token_rewards``
read them (``algo=reinforce_pp_baseline``, ``reinforce_pp``, ``remax``, ``gae``...);
a PRM with another estimator is refused at start.

Paper: "Let's Verify Step by Step" (Lightman et al., arXiv:2305.20050) for
process reward models scoring each step; the per-step token rewards follow
"Math-Shepherd" (Wang et al., arXiv:2312.08935), which rewards PPO at step ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import torch

from rlpost.core.errors import ConfigError
from rlpost.core.registry import Choice, param
from rlpost.tasks.steps import SEGMENTERS, Span, char_to_token, policy_step_positions, segment_steps
from rlpost.rewards.models import (
    REWARD_MODELS, ModelReward, ModelScore, check_head, length_batches, load_classifier, render_chat, render_prefix,
    sequence_scores,
)

def place_token_rewards(token_rewards: Sequence[Sequence[Tuple[int, float]]], response_mask: torch.Tensor,
                        shared_prefix_len: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, R]`` float32 token rewards from per-row ``(token index, reward)`` pairs.

    A pair's index counts tokens of the row's whole response text; a tree
    branch's shared prefix (``shared_prefix_len`` ``[B]``) is subtracted and
    pairs inside it are dropped (its tokens belong to the parent row). An index
    past the row's last response token lands on that token; rewards at one
    position add up.

    Raises:
        ValueError: ``token_rewards`` has another number of rows than the mask.
    """
    B, R = response_mask.shape
    if len(token_rewards) != B:
        raise ValueError(f"token rewards for {len(token_rewards)} rows, batch has {B}")
    out = torch.zeros(B, R, dtype=torch.float32)
    for b, row in enumerate(token_rewards):
        pos = (response_mask[b] > 0).nonzero().flatten()
        if not len(pos):
            continue
        pre = int(shared_prefix_len[b]) if shared_prefix_len is not None else 0
        for t, r in row:
            t = int(t) - pre
            if t < 0:
                continue
            out[b, int(pos[min(t, len(pos) - 1)])] += float(r)
    return out


class StepTransform(Choice):
    """How a step's head output becomes its reward."""

    sigmoid = "sigmoid"
    raw = "raw"


class StepOutcome(Choice):
    """What a PRM adds to the sequence-level reward besides its token rewards."""

    none = "none"
    min = "min"
    last = "last"
    mean = "mean"


@dataclass(frozen=True)
class PRMParams:
    """A process reward model scoring each step (token-classification or sequence-classification head)."""

    model_path: str = param("", "local directory of the PRM (a ...ForTokenClassification or ...ForSequenceClassification checkpoint)")
    segment: str = param("newline", "step segmentation rule: newline | step_k | sentence")
    transform: StepTransform = param(StepTransform.sigmoid, "sigmoid (a step reward in (0, 1)) | raw (the head's output)")
    outcome: StepOutcome = param(StepOutcome.none, "sequence reward from the step scores too: none | min | last | mean")
    batch_size: int = param(16, "rows per forward pass (all steps of a row are scored in the same pass)")
    max_length: int = param(1024, "tokens per rendered conversation; steps past it get no reward")


@REWARD_MODELS.register("prm", params=PRMParams, paper="Let's Verify Step by Step (arXiv:2305.20050)",
                        description="process reward model: each step's score on its last token (token rewards)")
class ProcessRewardModel(ModelReward):
    """Scores every step of each response in one forward pass per micro-batch; rewards on step-end tokens.

    Each row is rendered with the PRM's chat template (:func:`render_chat`);
    the steps found by the ``segment`` rule in the response are located in the
    rendered text, and the head is read at each step's last token
    (:func:`rlpost.rewards.models.sequence_scores` with ``[N, K]`` positions:
    the PRM sees the prefix up to and including that step, causally). Scores
    go to the policy's step-end tokens (:func:`policy_step_positions`).

    A response with no step gets no token reward and is counted
    (``reward/<name>_no_step_rows``). If **no** response of the first scored
    batch has a step, the segmentation rule does not fit the policy's output
    and the run stops there, at step 1, with the fix (nothing trained is lost).

    Raises:
        ConfigError: (``check``) no ``model_path``, an unknown segmentation
            rule, a checkpoint without a one- or two-label classification head;
            (``score``) no step in any response of the first batch.
    """

    token_level = True

    def __init__(self, *, model_path: str, segment: str, transform: str, outcome: str, batch_size: int,
                 max_length: int) -> None:
        self.model_path, self.segment = str(model_path), str(segment)
        self.transform, self.outcome = str(transform), str(outcome)
        self.batch_size, self.max_length = int(batch_size), int(max_length)
        self.model = self.tokenizer = self.policy_tokenizer = None
        self.device: Any = "cpu"
        self._calls = 0

    def check(self) -> None:
        if not self.model_path:
            raise ConfigError(f"task.reward.models.{self.name}: kind=prm needs model_path=DIR (a local PRM).")
        SEGMENTERS.entry(self.segment)
        check_head(self.model_path, f"task.reward.models.{self.name}",
                   allowed=("ForTokenClassification", "ForSequenceClassification"), num_labels=(1, 2))

    def attach(self, tokenizer: Any = None, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> None:
        self.policy_tokenizer, self.device = tokenizer, device
        self.model, self.tokenizer = load_classifier(self.model_path, dtype, device, token_level=True)

    def step_scores(self, responses: Sequence[str], examples: Sequence[Any]) -> Tuple[List[List[Span]], List[List[float]]]:
        """Steps (character spans in each response) and their scores, batched, no grad.

        Returns:
            ``(spans, scores)``: per row, the step spans and one transformed
            score per step (steps past ``max_length`` tokens are left out).
        """
        if self.model is None:
            self.attach()
        tok = self.tokenizer
        spans_all: List[List[Span]] = []
        enc_all: List[List[int]] = []
        pos_all: List[List[int]] = []
        for r, e in zip(responses, examples):
            spans = segment_steps(r, self.segment)
            pre = render_prefix(tok, self.task, e)
            full = render_chat(tok, self.task, e, r)
            at = len(pre) if full.startswith(pre) and full[len(pre):].startswith(r) else max(0, full.find(r))
            enc = tok(full, add_special_tokens=False, truncation=True, max_length=self.max_length,
                      return_offsets_mapping=True)
            offs = enc["offset_mapping"]
            keep = [(a, b) for a, b in spans if offs and at + b <= offs[-1][1]]
            spans_all.append(keep)
            enc_all.append(list(enc["input_ids"]))
            pos_all.append([char_to_token(offs, at + b) for _, b in keep])
        scores: List[List[float]] = [[] for _ in responses]
        pad = int(tok.pad_token_id)
        with torch.no_grad():
            for rows in length_batches([len(x) for x in enc_all], self.batch_size):
                rows = [i for i in rows if pos_all[i]]
                if not rows:
                    continue
                T = max(len(enc_all[i]) for i in rows)
                K = max(len(pos_all[i]) for i in rows)
                ids = torch.full((len(rows), T), pad, dtype=torch.long)
                att = torch.zeros((len(rows), T), dtype=torch.long)
                pos = torch.zeros((len(rows), K), dtype=torch.long)
                for j, i in enumerate(rows):
                    ids[j, :len(enc_all[i])] = torch.tensor(enc_all[i])
                    att[j, :len(enc_all[i])] = 1
                    pos[j, :len(pos_all[i])] = torch.tensor(pos_all[i])
                s = sequence_scores(self.model, ids.to(self.device), att.to(self.device), pos.to(self.device)).cpu()
                if self.transform == "sigmoid":
                    s = torch.sigmoid(s)
                for j, i in enumerate(rows):
                    scores[i] = [float(x) for x in s[j, :len(pos_all[i])]]
        return spans_all, scores

    def score(self, responses: Sequence[str], examples: Sequence[Any], prior: Mapping[str, ModelScore]) -> ModelScore:
        spans, scores = self.step_scores(responses, examples)
        self._calls += 1
        none = sum(1 for s in spans if not s)
        if self._calls == 1 and len(responses) and none == len(responses):
            raise ConfigError(
                f"task.reward.models.{self.name}: segmentation rule segment={self.segment!r} found no steps in any of "
                f"the {len(responses)} responses of the first batch (e.g. {responses[0][:60]!r}), so the PRM would "
                f"give no reward. Fix: task.reward.models.{self.name}.segment=newline or sentence, or a prompt "
                f"(task.system_prompt) that asks for that step format.")
        token: List[List[Tuple[int, float]]] = []
        vals = torch.zeros(len(responses), dtype=torch.float32)
        for i, (r, sp, sc) in enumerate(zip(responses, spans, scores)):
            pos = policy_step_positions(self.policy_tokenizer, r, sp) if (sp and self.policy_tokenizer is not None) \
                else list(range(len(sp)))
            token.append(list(zip(pos, sc)))
            if sc and self.outcome != "none":
                vals[i] = {"min": min(sc), "last": sc[-1], "mean": sum(sc) / len(sc)}[self.outcome]
        n_steps = sum(len(s) for s in scores)
        mean_step = sum(sum(s) for s in scores) / max(1, n_steps)
        return ModelScore(vals, 0, {f"reward/{self.name}_no_step_rows": float(none),
                                    f"reward/{self.name}_steps_per_row": n_steps / max(1, len(responses)),
                                    f"reward/{self.name}_step_score_mean": mean_step},
                          token_rewards=token, raw=vals)

    def close(self) -> None:
        self.model = None
