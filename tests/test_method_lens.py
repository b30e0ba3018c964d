"""LENS (arXiv:2601.21244): the interference detector on a bigram model by hand, the transfer plan and CRPO's
weights and anchor by hand, a step with a fake engine whose prompts fail while they hold the interference token
(only triggered groups purified, purified rows trained under the original prompt), config errors, and one
recipe step on the tiny model."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from fake_engine import FakeEngine, scorer
from rlpost.core.errors import ConfigError
from rlpost.methods.lens import calibrated_old_logprobs
from rlpost.rollout.base import SamplingParams
from rlpost.samplers.base import SamplerContext
from rlpost.samplers.lens import (LENSParams, LENSSampler, deletion_count, interference_scores, prompt_logprobs,
                                  purify, question_span, select_interference, transfer_plan, calibration_weights)

V = 12
LN10 = math.log(V)  # uniform log-prob of the reference: -ln 12


class Bigram(torch.nn.Module):
    """A bigram LM: the logits of the next token are row ``x_t`` of ``table`` ([V, V])."""

    def __init__(self, edits=()):
        super().__init__()
        t = torch.zeros(V, V)
        for (a, b), v in edits:
            t[a, b] = v
        self.table = torch.nn.Parameter(t, requires_grad=False)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.table[input_ids])


#: the policy likes 7 after 6 (logit ln 12) and dislikes 5 after 1 (logit -5); the reference is uniform
POLICY = Bigram([((6, 7), math.log(V)), ((1, 5), -5.0)])
REF = Bigram()


def test_interference_scores_and_selection_by_hand():
    ids = [1, 5, 6, 7, 8]
    lp, lr = prompt_logprobs(POLICY, ids), prompt_logprobs(REF, ids)
    assert lr.tolist() == pytest.approx([-LN10] * 4)
    # log p(5|1) = -5 - ln(11 + e^-5); log p(7|6) = ln 12 - ln(11 + 12) = ln(12/23); the others ln(1/12)
    d1 = -5.0 - math.log(11 + math.exp(-5.0)) + LN10  # -4.9136
    d3 = math.log(12 / 23) + LN10  # ln(144/23) = 1.8343
    s = interference_scores(lp, lr, "abs")
    assert s.tolist() == pytest.approx([abs(d1), 0.0, d3, 0.0], abs=1e-6)
    assert interference_scores(lp, lr, "signed").tolist() == pytest.approx([d1, 0.0, d3, 0.0], abs=1e-6)
    full = torch.cat([torch.zeros(1, dtype=torch.float64), s])  # position 0 has no prefix
    elig = torch.tensor([False, True, True, True, True])
    # k = ceil(0.05 * 4) = 1: abs picks token 5 (position 1), the signed score token 7 (position 3)
    assert select_interference(full, elig, 0.05) == [1]
    signed = torch.cat([torch.zeros(1, dtype=torch.float64), interference_scores(lp, lr, "signed")])
    assert select_interference(signed, elig, 0.05) == [3]
    # k = ceil(0.5 * 4) = 2: positions 1 and 3; k = 3 adds the earliest of the zero-score ties (position 2)
    assert select_interference(full, elig, 0.5) == [1, 3]
    assert select_interference(full, elig, 0.75) == [1, 2, 3]
    assert select_interference(full, torch.tensor([False, False, True, True, True]), 0.05) == [3]  # 5 not eligible
    assert purify(ids, [1, 3]) == [1, 6, 8]
    assert [deletion_count(n, 0.05) for n in (0, 1, 20, 21, 40)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        interference_scores(lp, lr[:2])


def test_question_span_transfer_plan_and_weights_by_hand():
    assert question_span([10, 11, 12, 13, 14], [10, 11, 14]) == (2, 4)
    assert question_span([10, 11, 12, 14], [10, 11, 14]) == (2, 3)
    # a = 1/4 < a' = 3/4: the 3 failures (rows 1, 2, 3) swapped for the 3 purified successes (0, 1, 3)
    assert transfer_plan([True, False, False, False], [True, True, False, True]) == ([1, 2, 3], [0, 1, 3])
    # a' = 1/4 -> only 1 purified success to move in: the first failure goes
    assert transfer_plan([False, False, False, False], [False, True, False, False]) == ([0], [1])
    assert transfer_plan([True, False, False, False], [True, False, False, False]) == ([], [])  # not higher
    assert transfer_plan([False, False], [False, False]) == ([], [])
    # w~: a for an original success, 1 - a for purified rows and failures kept
    assert calibration_weights(0.25, [True, False, True], [False, False, True]) == [0.25, 0.75, 0.75]


def test_crpo_anchor_and_the_clip_loss_ratio_by_hand():
    from rlpost.algos.losses import PolicyLossInput, compute_policy_loss

    old = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    rollout = torch.tensor([[-3.0, -1.0], [-0.4, -0.6]])
    anchor = calibrated_old_logprobs(old, rollout, torch.tensor([1.0, 0.0]), torch.tensor([0.75, 0.25]))
    # row 0 purified: the engine's log-probs + ln 0.75; row 1 original: the trainer's + ln 0.25
    assert anchor.flatten().tolist() == pytest.approx([-3.0 + math.log(0.75), -1.0 + math.log(0.75),
                                                       -0.5 + math.log(0.25), -0.5 + math.log(0.25)])
    lp = torch.tensor([[-2.0, -1.0], [-0.5, -0.5]])
    # rho = pi(y|x) / (w~ pi_old(y|x_roll)): e / 0.75 = 3.6244, 1 / 0.75 = 1.3333; 1 / 0.25 = 4
    rho = torch.exp(lp - anchor)
    assert rho.flatten().tolist() == pytest.approx([math.e / 0.75, 1 / 0.75, 4.0, 4.0])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, _ = compute_policy_loss("ppo_clip", PolicyLossInput(logprobs=lp, old_logprobs=anchor, advantages=adv,
                                                              response_mask=torch.ones(2, 2)))
    # -min(rho A, clip(rho, 0.8, 1.2) A): 1.2 capped for A = 1; 4 (the unclipped side) for A = -1
    assert loss.flatten().tolist() == pytest.approx([-1.2, -1.2, 4.0, 4.0])
    with pytest.raises(ValueError):
        calibrated_old_logprobs(old, rollout, torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]))


class NoisyEngine(FakeEngine):
    """A prompt holding token 7 fails, except a prompt holding 9 whose first row of a call succeeds; a prompt
    without 7 always succeeds. Log-probs -0.5 per token (FakeEngine)."""

    def __init__(self):
        super().__init__({}, resp_len=4)

    def generate(self, prompts, params):
        g = super().generate(prompts, params)  # every row fails (first token 4)
        seen = set()
        for b, pr in enumerate(prompts):
            first = tuple(pr) not in seen
            seen.add(tuple(pr))
            if 7 not in pr or (9 in pr and first):
                g.response_ids[b, 0] = 3
        g.texts = [self.tokenizer.decode(r[m > 0].tolist()) for r, m in zip(g.response_ids, g.response_mask)]
        return g


def _sampler(n=4, **kw):
    p = dataclasses.asdict(LENSParams())
    p.update({"scope": "prompt", **kw})
    s = LENSSampler(n, **p)
    s.set_models(Bigram([((6, 7), math.log(V))]), REF)  # 7 after 6 is the interference token
    return s


def test_only_triggered_groups_are_purified_and_trained_on_the_original_prompt():
    P = [[1, 5, 6, 7, 8], [2, 5, 6, 7, 9], [3, 5, 6]]  # a = 0, a = 1/4 (both < 0.5), a = 1
    eng, calls = NoisyEngine(), []
    res = _sampler().sample(eng, P, SamplingParams(max_new_tokens=8, seed=3), SamplerContext(score=scorer(calls=calls)))
    # call 1: only the triggered prompts, token 7 deleted, 4 rollouts each
    assert eng.calls[1] == [[1, 5, 6, 8]] * 4 + [[2, 5, 6, 9]] * 4
    assert res.rollouts_spent == 20 and sum(calls) == 20
    # kept original rows first (prompt 1's success, prompt 2's four), then the 4 + 3 purified successes
    assert res.group_index.tolist() == [1, 2, 2, 2, 2] + [0] * 4 + [1] * 3
    assert res.extras["lens_purified"].tolist() == [0.0] * 5 + [1.0] * 7
    # w~: prompt 0 (a = 0) -> 1 on purified rows; prompt 1 (a = 1/4): its success 0.25, purified 0.75; prompt 2: 1
    assert res.extras["lens_weight"].tolist() == pytest.approx([0.25, 1, 1, 1, 1, 1, 1, 1, 1, 0.75, 0.75, 0.75])
    assert res.rewards.tolist() == [1.0] * 12
    g = res.generation
    for r in range(12):  # every row is trained under its original prompt
        assert g.prompt_ids[r][g.prompt_mask[r] > 0].tolist() == P[int(res.group_index[r])]
    assert res.dropped == [(0, [0.0] * 4), (1, [0.0] * 3)]
    m = res.metrics
    assert (m["sampler/lens_prompts_triggered"], m["sampler/lens_prompts_transferred"], m["sampler/lens_rows_replaced"],
            m["sampler/lens_purified_solved_rate"], m["sampler/lens_tokens_deleted_mean"]) == (2.0, 2.0, 7.0, 1.0, 1.0)


def test_a_higher_threshold_triggers_more_and_no_improvement_keeps_the_group():
    # tau = 1: a prompt that always succeeds (a = 1) is still not below it: one engine call, nothing purified
    eng = NoisyEngine()
    res = _sampler(success_threshold=1.0).sample(eng, [[3, 5, 6]], SamplingParams(max_new_tokens=8, seed=3),
                                                 SamplerContext(score=scorer()))
    assert len(eng.calls) == 1 and res.metrics["sampler/lens_prompts_triggered"] == 0.0
    # a group whose purified prompt does no better keeps its rows (weights 1): the detector deletes 5, not 7
    s = _sampler()
    s.set_models(Bigram([((1, 5), 5.0)]), REF)
    res = s.sample(NoisyEngine(), [[1, 5, 6, 7, 8]], SamplingParams(max_new_tokens=8, seed=3),
                   SamplerContext(score=scorer()))
    assert res.metrics["sampler/lens_prompts_triggered"] == 1.0 and res.metrics["sampler/lens_rows_replaced"] == 0.0
    assert res.extras["lens_weight"].tolist() == [1.0] * 4 and res.rollouts_spent == 8


@pytest.mark.parametrize("kw", [dict(deletion_ratio=0.0), dict(deletion_ratio=1.5), dict(success_threshold=0.0),
                                dict(purified_samples=-1), dict(score="kl"), dict(scope="all")])
def test_bad_parameters_raise(kw):
    p = dataclasses.asdict(LENSParams())
    p.update(kw)
    with pytest.raises(ValueError):
        LENSSampler(4, **p)


def test_no_reference_is_a_config_error():
    s = LENSSampler(4, **dataclasses.asdict(LENSParams()))
    with pytest.raises(ConfigError, match="frozen reference"):
        s.set_models(POLICY, None)
    with pytest.raises(ConfigError, match="frozen reference"):
        s.sample(NoisyEngine(), [[1, 5, 6, 7]], SamplingParams(max_new_tokens=8, seed=3),
                 SamplerContext(score=scorer()))
    assert s.state_dict() == {}


def test_recipe_and_config_errors(compose):
    from rlpost.config.compose import validate_config
    from rlpost.methods.base import MethodSet

    cfg = compose(["+recipe=lens", "model=tiny", "logger=none"])
    validate_config(cfg)
    assert cfg.sampler.name == "lens"
    needs = MethodSet.for_config(cfg).needs()
    assert needs.reference_policy and needs.old_logprobs
    for bad in (["sampler=lens", "+sampler.params.deletion_ratio=0"],
                ["sampler=lens", "+sampler.params.deletion_rato=0.1"],
                ["sampler=lens", "precision.correction=tis"]):
        with pytest.raises(ConfigError):
            cfg = compose(["model=tiny", "logger=none", *bad])
            validate_config(cfg)
            MethodSet.for_config(cfg)


@pytest.mark.usefixtures("one_thread")
def test_recipe_one_step_on_the_tiny_model(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["+recipe=lens", "model=tiny", "steps=1", "logger=jsonl", "selector.prompts_per_step=2",
                          "rollout.max_new_tokens=8", "eval.at_end=false", "eval.at_start=false", "checkpoint.every=0"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert math.isfinite(r["loss/policy"])
    # the random tiny model solves nothing: both prompts are triggered, each loses one question token
    assert r["sampler/lens_prompts_triggered"] == 2.0 and r["sampler/lens_tokens_deleted_mean"] >= 1.0
    assert r["rollout/spent"] == 16.0  # 2 x 4 original + 2 x 4 purified


def test_method_rewrites_the_old_logprobs_after_the_pass():
    from rlpost.methods.lens import LENS

    batch = SimpleNamespace(rollout_logprobs=torch.tensor([[-3.0, -1.0], [-0.4, -0.6]]),
                            extras={"old_logprobs": torch.tensor([[-1.0, -2.0], [-0.5, -0.5]]),
                                    "lens_purified": torch.tensor([1.0, 0.0]), "lens_weight": torch.tensor([1.0, 1.0])})
    m = LENS(None).after_old_logprobs(batch, None)
    # w~ = 1: the purified row's anchor is the engine's log-probs, the other row keeps the trainer's
    assert batch.extras["old_logprobs"].flatten().tolist() == pytest.approx([-3.0, -1.0, -0.5, -0.5])
    assert m == {"lens/purified_rows": 1.0, "lens/weight_mean": 1.0}
    plain = SimpleNamespace(rollout_logprobs=None, extras={"old_logprobs": torch.zeros(1, 2)})
    assert LENS(None).after_old_logprobs(plain, None) == {} and plain.extras["old_logprobs"].sum() == 0


def test_question_scope_scores_only_the_question_tokens():
    @dataclasses.dataclass
    class Ex:
        question: str

    class Task:  # renders [1, 2] + question + [2] (a template around the question)
        def render_prompt(self, ex, tok):
            return [1, 2] + tok.encode(ex.question) + [2]

    eng = NoisyEngine()
    prompt = [1, 2, 5, 4, 7, 2]  # "bad": b = 5, a = 4, d = 7
    ctx = SamplerContext(prompt_indices=[0])
    q = _sampler(scope="question")
    q.attach(task=Task(), examples=[Ex("bad")])
    assert q.eligible(eng, prompt, 0, ctx).tolist() == [False, False, True, True, True, False]
    p = _sampler(scope="prompt")
    p.attach(task=Task(), examples=[Ex("bad")])
    assert p.eligible(eng, prompt, 0, ctx).tolist() == [False, True, True, True, True, True]
    # a prompt that is not the example's rendering (another source) falls back to every non-first token
    assert q.eligible(eng, [9, 2, 5], 0, ctx).tolist() == [False, True, True]
    # the policy's strongest deviation is on the template's last token (2 after 7): question scope skips it
    q.set_models(Bigram([((7, 2), 4.0), ((4, 7), 1.0)]), REF)
    p.set_models(Bigram([((7, 2), 4.0), ((4, 7), 1.0)]), REF)
    assert q.interference(eng, prompt, 0, ctx) == [4] and p.interference(eng, prompt, 0, ctx) == [5]
