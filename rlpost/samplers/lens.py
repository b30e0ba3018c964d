"""``sampler=lens``: LENS purifies the prompts of low-success groups and trains the original prompts on the result.

"Less Noise, More Voice: Reinforcement Learning for Reasoning via Instruction
Purification" (Guo, Hu, Sun, Lin; arXiv:2601.21244), the Less Noise Sampling
Framework (LENS). Many groups fail not because the problem is hard but because a
few prompt tokens ("interference tokens") derail the rollouts. LENS finds them,
deletes them, samples again on the purified prompt, and puts the purified prompt's
successful rollouts into the group of the *original* prompt, where they are trained
under the original prompt with an off-policy correction (Calibrated Rollout Policy
Optimization, CRPO: :mod:`rlpost.methods.lens`).

What was read: the abstract and public summaries of the paper's method section,
which quote its formulas (the full text and the authors' code were not reachable
here). Followed from them:

* **Interference score** of prompt token ``a`` after prefix ``s``:
  ``S_I(s, a) = |log pi_theta(a|s) - log pi_ref(a|s)|`` (current policy against the
  frozen reference; two summaries quote the absolute value, one the signed
  difference: ``score=signed`` offers it), :func:`interference_scores`.
* **Purification**: the ``k = ceil(gamma |x_i|)`` highest-scoring tokens of prompt
  ``x_i`` are deleted (``gamma`` 1%-5% in the paper; ``deletion_ratio``),
  :func:`select_interference`, :func:`purify`.
* **Trigger**: a prompt whose success rate ``a_i`` on its group is below ``tau``
  (``success_threshold``; 0.5 as a summary quotes it) is purified and sampled again.
* **Transfer**: when the purified prompt's success rate is higher, as many of the
  original group's failed rollouts as there are purified successes (at most all
  failures) are replaced by purified successes (:func:`transfer_plan`); the group's
  advantages are then computed on the reconstructed group as usual.
* **Sample weights** ``w~``: original successes ``a_i``, purified successes and the
  failures left ``1 - a_i`` (:func:`calibration_weights`); they enter the ratio
  ``rho = pi_theta(y|x_i) / (w~(y) pi_old(y|x_roll(y)))`` (:mod:`rlpost.methods.lens`).

Our reading, where the summaries are silent (each a parameter or declared here):

* **Which tokens may be deleted** (``scope``): ``question`` (default) scores only the
  problem text's tokens inside the rendered prompt (the instruction the paper
  purifies; deleting chat-template tokens would break the format), found as the
  span that differs between the prompt rendered with its question and with an empty
  one (:func:`question_span`); ``prompt`` scores every prompt token after the first
  that is not a special token. ``|x_i|`` counts the scored tokens. Ties go to the
  earlier token.
* **Budget**: the purified prompt gets ``purified_samples`` rollouts (0: the group
  size) on top of the group's; failures replaced are the earliest in row order,
  purified successes taken are the earliest drawn. A group whose purified success
  rate is not higher keeps its original rollouts, with weight 1.
* **Off-policy rows**: a purified row's prompt ids are swapped back to the original
  prompt (``train_on=original`` of ``sampler=xrpo_icl``, whose helper this reuses);
  its ``rollout_logprobs`` stay the engine's, i.e. ``log pi_old(y|x')`` of the
  purified prompt, which CRPO's ratio uses as the behaviour policy.
* Replaced original failures are reported in ``SampleResult.dropped`` (so a selector
  sees the original prompt's real outcomes); purified rows left out are not (they
  answer another prompt).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from rlpost.core.errors import ConfigError
from rlpost.core.registry import Choice, param
from rlpost.samplers.base import SAMPLERS, SampleResult, Sampler, generate_groups, merge_results, pad_id_of, \
    score_rows, select_rows, step_params
from rlpost.samplers.xrpo_icl import XRPOICLSampler

PAPER = "Less Noise, More Voice: Reinforcement Learning for Reasoning via Instruction Purification (arXiv:2601.21244)"


class Score(Choice):
    """How a prompt token's interference score compares the policy with the reference."""

    abs = "abs"
    signed = "signed"


class Scope(Choice):
    """Which prompt tokens may be deleted."""

    question = "question"
    prompt = "prompt"


@dataclass(frozen=True)
class LENSParams:
    """LENS's purification (arXiv:2601.21244); gamma and tau inside the paper's ranges, the rest our choices."""

    deletion_ratio: float = param(0.05, "gamma, share of a prompt's scored tokens deleted, k = ceil(gamma |x|) "
                                  "(the paper's range 0.01-0.05, larger for weaker models; ours the top of it)")
    success_threshold: float = param(0.5, "tau, a prompt whose group success rate is below this is purified "
                                     "(0.5 as a summary of the paper quotes it)")
    solved_at: float = param(1.0, "a rollout whose reward is at least this counts as a success")
    score: Score = param(Score.abs, "abs: |log pi - log pi_ref| (the summaries' S_I); signed: log pi - log pi_ref")
    scope: Scope = param(Scope.question, "question: only the problem text's tokens may be deleted; prompt: every "
                         "non-special prompt token after the first")
    purified_samples: int = param(0, "rollouts drawn on a purified prompt (0: the prompt's group size)")


# ----------------------------------------------------------------- detector
@torch.no_grad()
def prompt_logprobs(model: torch.nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """``[L - 1]`` float64 ``log p(x_t | x_<t)`` of prompt tokens ``t = 1 .. L-1`` under ``model`` (nats, temperature 1).

    One unpadded forward of the prompt (no grad); ``model(input_ids=, attention_mask=)`` must return ``.logits``.
    A prompt of fewer than 2 tokens gives an empty tensor.
    """
    if len(ids) < 2:
        return torch.zeros(0, dtype=torch.float64)
    dev = next(iter(model.parameters())).device
    x = torch.as_tensor(list(ids), dtype=torch.long, device=dev)[None]
    logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1).cpu()


def interference_scores(policy_lp: torch.Tensor, ref_lp: torch.Tensor, score: str = "abs") -> torch.Tensor:
    """LENS's interference score ``S_I = |log pi_theta(a|s) - log pi_ref(a|s)|`` per prompt token (``score=abs``),
    or the signed difference (``score=signed``); ``[n]`` in, ``[n]`` out (nats).

    Raises:
        ValueError: shapes differ or ``score`` is neither ``abs`` nor ``signed``.
    """
    if policy_lp.shape != ref_lp.shape:
        raise ValueError(f"policy and reference log-probs differ in shape: {tuple(policy_lp.shape)} vs "
                         f"{tuple(ref_lp.shape)}")
    d = policy_lp.double() - ref_lp.double()
    if score == "abs":
        return d.abs()
    if score == "signed":
        return d
    raise ValueError(f"score={score!r} must be abs or signed")


def deletion_count(n: int, ratio: float) -> int:
    """``k = ceil(ratio * n)`` tokens deleted out of ``n`` scored ones (0 when ``n = 0``; at most ``n``)."""
    if n <= 0:
        return 0
    return min(int(n), int(math.ceil(float(ratio) * int(n) - 1e-9)))


def select_interference(scores: torch.Tensor, eligible: torch.Tensor, ratio: float) -> List[int]:
    """Positions (ascending) of the ``ceil(ratio * n)`` highest ``scores`` among the ``n`` ``eligible`` ones.

    Args:
        scores: ``[L]`` a score per prompt position (ineligible positions are ignored).
        eligible: ``[L]`` bool, the positions that may be deleted.
        ratio: ``gamma``, in (0, 1].
    Ties go to the earlier position.
    """
    pos = [i for i in range(int(scores.shape[0])) if bool(eligible[i])]
    k = deletion_count(len(pos), ratio)
    ranked = sorted(pos, key=lambda i: (-float(scores[i]), i))
    return sorted(ranked[:k])


def purify(ids: Sequence[int], positions: Sequence[int]) -> List[int]:
    """``ids`` without the tokens at ``positions`` (the purified prompt ``x'``)."""
    drop = set(int(p) for p in positions)
    return [int(t) for i, t in enumerate(ids) if i not in drop]


def question_span(plain: Sequence[int], blank: Sequence[int]) -> Tuple[int, int]:
    """``(start, end)`` of the question's tokens in ``plain`` (a prompt rendered with its question), given ``blank``
    (the same prompt rendered with an empty question): the part between their longest common prefix and suffix."""
    p = 0
    while p < min(len(plain), len(blank)) and plain[p] == blank[p]:
        p += 1
    s = 0
    while s < min(len(plain), len(blank)) - p and plain[len(plain) - 1 - s] == blank[len(blank) - 1 - s]:
        s += 1
    return p, len(plain) - s


# ----------------------------------------------------------------- transfer
def transfer_plan(orig_solved: Sequence[bool], pur_solved: Sequence[bool]) -> Tuple[List[int], List[int]]:
    """``(original rows replaced, purified rows taken)`` of one triggered group (indices within each list).

    When the purified success rate is higher than the original one, the first ``m`` failed original rows are
    replaced by the first ``m`` successful purified rows, ``m = min(purified successes, original failures)``;
    else nothing is replaced (``([], [])``).
    """
    if not orig_solved or not pur_solved:
        return [], []
    a = sum(map(bool, orig_solved)) / len(orig_solved)
    a_p = sum(map(bool, pur_solved)) / len(pur_solved)
    if a_p <= a:
        return [], []
    fails = [i for i, ok in enumerate(orig_solved) if not ok]
    wins = [j for j, ok in enumerate(pur_solved) if ok]
    m = min(len(fails), len(wins))
    return fails[:m], wins[:m]


def calibration_weights(success_rate: float, solved: Sequence[bool], purified: Sequence[bool]) -> List[float]:
    """CRPO's sample weights ``w~`` of a reconstructed group whose original success rate is ``success_rate``:
    ``a`` for an original success, ``1 - a`` for a purified row and for an original failure kept."""
    a = float(success_rate)
    return [1.0 - a if p else (a if s else 1.0 - a) for s, p in zip(solved, purified)]


@SAMPLERS.register("lens", paper=PAPER, params=LENSParams,
                   description="Groups below tau: delete the prompt's top-scored interference tokens, sample again, "
                               "move purified successes into the original group (CRPO).")
class LENSSampler(Sampler):
    """LENS (module docstring). One step, per prompt with ``c`` rollouts (``n_samples`` or the selector's count):

    1. ``c`` rollouts of the prompt (engine call 0), scored; ``a`` = share with reward ``>= solved_at``;
    2. a prompt with ``a < success_threshold`` is *triggered*: its tokens are scored with
       :func:`interference_scores` (the trainer's policy against the frozen reference, :func:`prompt_logprobs`),
       the ``ceil(gamma n)`` highest of its ``n`` scored tokens deleted (:func:`select_interference`), and
       ``purified_samples`` rollouts drawn on the purified prompt (engine call 1), scored;
    3. :func:`transfer_plan` swaps failed original rows for purified successes; purified rows get the
       original prompt's ids back; :func:`calibration_weights` gives each row of a changed group its ``w~``.

    Extras ``[B]``: ``lens_purified`` (1.0 on purified rows), ``lens_weight`` (``w~``; 1.0 outside changed
    groups). Metrics: ``sampler/lens_prompts_triggered``, ``lens_prompts_transferred``, ``lens_rows_replaced``,
    ``lens_purified_solved_rate``, ``lens_tokens_deleted_mean``.

    The policy and reference come from the run (:meth:`setup`: ``algo=lens``'s method makes the trainer keep a
    frozen reference) or :meth:`set_models` (tests).

    Raises:
        ValueError: (construction) ``deletion_ratio`` outside (0, 1], ``success_threshold`` outside (0, 1],
            ``purified_samples < 0``, an unknown ``score`` or ``scope``.
        ConfigError: (:meth:`setup` / :meth:`sample`) the run has no frozen reference policy.
    """

    uses_rollout_counts = True

    def __init__(self, n_samples: int, *, deletion_ratio: float, success_threshold: float, solved_at: float,
                 score: str, scope: str, purified_samples: int) -> None:
        super().__init__(n_samples)
        if not 0.0 < float(deletion_ratio) <= 1.0:
            raise ValueError(f"deletion_ratio={deletion_ratio} must be in (0, 1] (the paper's gamma is 0.01-0.05)")
        if not 0.0 < float(success_threshold) <= 1.0:
            raise ValueError(f"success_threshold={success_threshold} must be in (0, 1] (a group below it is purified)")
        if int(purified_samples) < 0:
            raise ValueError(f"purified_samples={purified_samples} must be >= 0 (0: the group size)")
        if str(score) not in ("abs", "signed"):
            raise ValueError(f"score={score!r} must be abs or signed")
        if str(scope) not in ("question", "prompt"):
            raise ValueError(f"scope={scope!r} must be question or prompt")
        self.ratio, self.tau, self.solved_at = float(deletion_ratio), float(success_threshold), float(solved_at)
        self.score, self.scope, self.purified_samples = str(score), str(scope), int(purified_samples)
        self.policy: Optional[torch.nn.Module] = None
        self.reference: Optional[torch.nn.Module] = None
        self.task: Any = None
        self.examples: Optional[List[Any]] = None
        self.special: set = set()

    # ------------------------------------------------------------ wiring
    def attach(self, task: Any = None, examples: Optional[List[Any]] = None, run_dir: Any = None) -> None:
        """The run's task and training examples (to find the question's tokens, ``scope=question``)."""
        self.task, self.examples = task, examples

    def setup(self, run: Any) -> None:
        """Take the trainer's policy and frozen reference from the run's services (called once by the runner).

        Raises:
            ConfigError: the run keeps no reference policy.
        """
        self.set_models(run.policy, run.reference_policy)

    def set_models(self, policy: torch.nn.Module, reference: Optional[torch.nn.Module]) -> None:
        """Use ``policy`` (pi_theta) and ``reference`` (pi_ref) for the interference scores.

        Raises:
            ConfigError: ``reference`` is None.
        """
        if reference is None:
            raise ConfigError("sampler=lens scores prompt tokens against the frozen reference policy, and this run "
                              "keeps none. Fix: use sampler=lens with its method (it is on whenever sampler=lens; "
                              "a run built without rlpost.run keeps none: call set_models with one).")
        self.policy, self.reference = policy, reference

    # ------------------------------------------------------------ detector
    def eligible(self, engine: Any, prompt: Sequence[int], pos: int, ctx: Any) -> torch.Tensor:
        """``[L]`` bool: the positions of ``prompt`` that may be deleted (module docstring, ``scope``)."""
        L = len(prompt)
        ok = torch.zeros(L, dtype=torch.bool)
        if L < 2:
            return ok
        tok = getattr(engine, "tokenizer", None)
        special = set(getattr(tok, "all_special_ids", []) or [])
        ok[1:] = torch.tensor([int(t) not in special for t in prompt[1:]], dtype=torch.bool)
        if self.scope == "question" and self.task is not None and self.examples is not None \
                and ctx.prompt_indices is not None:
            ex = self.examples[int(ctx.prompt_indices[pos])]
            plain = list(self.task.render_prompt(ex, tok))
            if list(prompt)[: len(plain)] == plain:
                blank = list(self.task.render_prompt(dataclasses.replace(ex, question=""), tok))
                a, b = question_span(plain, blank)
                span = torch.zeros(L, dtype=torch.bool)
                span[max(a, 1): b] = True
                ok &= span
        return ok

    def interference(self, engine: Any, prompt: Sequence[int], pos: int, ctx: Any) -> List[int]:
        """Positions of ``prompt``'s interference tokens (:func:`select_interference` of the scores)."""
        if self.reference is None or self.policy is None:
            self.set_models(self.policy, self.reference)  # raises the ConfigError
        lp = prompt_logprobs(self.policy, prompt)
        lr = prompt_logprobs(self.reference, prompt)
        s = torch.cat([torch.zeros(1, dtype=torch.float64), interference_scores(lp, lr, self.score)])
        return select_interference(s[: len(prompt)], self.eligible(engine, prompt, pos, ctx), self.ratio)

    # ------------------------------------------------------------ sampling
    def sample(self, engine, prompts, params, ctx):  # noqa: D102 - see class
        counts = self.counts(len(prompts), ctx)
        pos0 = [i for i, c in enumerate(counts) if c > 0]
        res0 = generate_groups(engine, [prompts[i] for i in pos0], [counts[i] for i in pos0], params, positions=pos0)
        score_rows(ctx, res0)
        solved0 = (res0.rewards >= self.solved_at).tolist()
        rows_of: Dict[int, List[int]] = {}
        for r, g in enumerate(res0.group_index.tolist()):
            rows_of.setdefault(int(g), []).append(r)
        rate = {g: sum(solved0[r] for r in rs) / len(rs) for g, rs in rows_of.items()}
        triggered = [g for g in sorted(rows_of) if rate[g] < self.tau]
        deleted, pur_prompts, pur_counts = [], [], []
        for g in triggered:
            drop = self.interference(engine, prompts[g], g, ctx)
            deleted.append(len(drop))
            pur_prompts.append(purify(prompts[g], drop))
            pur_counts.append(self.purified_samples or len(rows_of[g]))
        weights = torch.ones(len(solved0))
        keep = list(range(len(solved0)))
        parts: List[SampleResult] = []
        taken: List[int] = []
        dropped: List[Tuple[int, List[float]]] = []
        spent = res0.rollouts_spent
        pur_solved_all: List[bool] = []
        transferred = 0
        if triggered:
            res1 = generate_groups(engine, pur_prompts, pur_counts, step_params(params, ctx, 1), positions=triggered)
            score_rows(ctx, res1)
            spent += res1.rollouts_spent
            solved1 = (res1.rewards >= self.solved_at).tolist()
            pur_solved_all = [bool(x) for x in solved1]
            pur_rows: Dict[int, List[int]] = {}
            for r, g in enumerate(res1.group_index.tolist()):
                pur_rows.setdefault(int(g), []).append(r)
            replaced: set = set()
            w_taken: List[float] = []
            for g in triggered:
                o, p = rows_of[g], pur_rows.get(g, [])
                out_i, in_j = transfer_plan([bool(solved0[r]) for r in o], [bool(solved1[r]) for r in p])
                if not out_i:
                    continue
                transferred += 1
                a = rate[g]
                gone = {o[i] for i in out_i}
                replaced |= gone
                dropped.append((g, [float(res0.rewards[r]) for r in sorted(gone)]))
                for r in o:
                    if r not in gone:
                        weights[r] = calibration_weights(a, [bool(solved0[r])], [False])[0]
                taken += [p[j] for j in in_j]
                w_taken += calibration_weights(a, [True] * len(in_j), [True] * len(in_j))
            keep = [r for r in range(len(solved0)) if r not in replaced]
            if taken:
                sub = self._rows(res1, taken)
                XRPOICLSampler._restore_prompts(sub, prompts, pad_id_of(engine))  # trained under the original prompt
                sub.extras["lens_purified"] = torch.ones(len(taken))
                sub.extras["lens_weight"] = torch.tensor(w_taken, dtype=torch.float32)
                parts.append(sub)
        if keep:
            base = self._rows(res0, keep)
            base.extras["lens_purified"] = torch.zeros(len(keep))
            base.extras["lens_weight"] = weights[keep].float()
            parts.insert(0, base)
        out = merge_results(parts, pad_id_of(engine)) if len(parts) > 1 else parts[0]
        out.rollouts_spent, out.dropped = spent, dropped
        out.metrics = {
            "sampler/lens_prompts_triggered": float(len(triggered)),
            "sampler/lens_prompts_transferred": float(transferred),
            "sampler/lens_rows_replaced": float(len(taken)),
            "sampler/lens_purified_solved_rate": (sum(pur_solved_all) / len(pur_solved_all)) if pur_solved_all else 0.0,
            "sampler/lens_tokens_deleted_mean": (sum(deleted) / len(deleted)) if deleted else 0.0,
        }
        return out

    @staticmethod
    def _rows(res: SampleResult, rows: Sequence[int]) -> SampleResult:
        """The scored sub-result of ``rows`` (generation, group index, rewards and ``[B]`` extras)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        return SampleResult(
            generation=select_rows(res.generation, list(rows)), group_index=res.group_index[idx],
            rollouts_spent=len(rows), extras={k: v[idx] for k, v in res.extras.items()},
            rewards=None if res.rewards is None else res.rewards[idx],
        )

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102 - the detector reads the live models; nothing to keep
        return {}
