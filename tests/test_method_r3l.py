"""R^3L (arXiv:2601.03715): the failure point parsed from a reflection, the restart prefix, the sampler's rows
on a scripted engine (prompts, tokens, log-probs, masks), Positive Amplification and the shared-prefix mask by
hand, the optional off-policy weight on one row, bad parameters, and a real tiny-model step of the recipe."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import CharTok, tiny_overrides
from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.r3l import positive_amplified, prefix_keep_mask, retry_importance_weight
from rlpost.core.errors import ConfigError
from rlpost.rollout.base import GenerationResult, SamplingParams
from rlpost.samplers.base import SamplerContext, build_sampler
from rlpost.samplers.r3l import (GUIDANCE_TEMPLATE, REFLECTION_PROMPT, STEP_PATTERN, first_count, numbered_steps,
                                 parse_failure_step, restart_prefix)
from rlpost.tasks.base import Example
from rlpost.tasks.steps import segment_steps

PARAMS = SamplingParams(max_new_tokens=10, seed=3)


# ----------------------------------------------------------------- the reflection's failure point
def test_failure_step_parsed_from_a_reflection_by_hand():
    text = "Step 1 adds 2 + 3 as 6, which is wrong.\nRetry from step: 1"
    assert parse_failure_step(text, STEP_PATTERN, 3) == 1
    # the release's JSON report field reads too
    assert parse_failure_step('{"trajectory_outcome": "failure", "retry_from_step": 2}', STEP_PATTERN, 3) == 2
    # the last match wins (a reflection that changes its mind); case and '_' / ' ' do not matter
    assert parse_failure_step("retry from step 0 ... RETRY_FROM_STEP = 2", STEP_PATTERN, 3) == 2
    # outside [0, number of steps) or absent: not retried
    assert parse_failure_step("Retry from step: 3", STEP_PATTERN, 3) is None
    assert parse_failure_step("Retry from step: N", STEP_PATTERN, 3) is None
    assert parse_failure_step("", STEP_PATTERN, 3) is None
    assert parse_failure_step("Retry from step: 0", STEP_PATTERN, 0) is None  # an attempt without steps


def test_restart_prefix_and_step_numbering_by_hand():
    text = "ab\ncd\nef"  # one token per character: steps (0, 2), (3, 5), (6, 8)
    spans = segment_steps(text, "newline")
    assert spans == [(0, 2), (3, 5), (6, 8)]
    assert numbered_steps(text, spans) == "Step 0: ab\nStep 1: cd\nStep 2: ef"
    tok = CharTok()
    # retry from step k keeps steps 0..k-1: up to and including step k-1's last token
    assert restart_prefix(tok, text, spans, 0, 8) == 0  # from scratch, with the reflection
    assert restart_prefix(tok, text, spans, 1, 8) == 2  # "ab"
    assert restart_prefix(tok, text, spans, 2, 8) == 5  # "ab\ncd"
    assert restart_prefix(tok, text, spans, 3, 8) is None  # the whole response: nothing to retry
    assert [first_count(c, 0.5) for c in (0, 1, 2, 3, 4, 8)] == [0, 1, 1, 1, 2, 4]


# ----------------------------------------------------------------- the sampler on a scripted engine
class Tok(CharTok):
    """CharTok (one token per character) with an encode, as the engine's tokenizer."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class ScriptEngine:
    """Call ``c`` answers row ``b`` with ``script[c][b]`` (a string: every row). Log-probs per call: -0.1, -0.3, -0.5."""

    pad_id = 0

    def __init__(self, script):
        self.tokenizer, self.script, self.calls = Tok(), script, []

    def generate(self, prompts, params):
        c = len(self.calls)
        self.calls.append(([list(p) for p in prompts], params))
        s = self.script[c]
        texts = [s if isinstance(s, str) else s[b] for b in range(len(prompts))]
        texts = [t[: params.max_new_tokens] for t in texts]
        B, P, R = len(prompts), max(len(p) for p in prompts), max(1, max(len(t) for t in texts))
        pid, pm = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
        rid, rm = torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R)
        for i, (p, t) in enumerate(zip(prompts, texts)):
            pid[i, P - len(p):], pm[i, P - len(p):] = torch.tensor(p), 1
            rid[i, : len(t)], rm[i, : len(t)] = torch.tensor([ord(x) for x in t], dtype=torch.long), 1
        lp = (-0.1, -0.3, -0.5, -0.7)[min(c, 3)]
        return GenerationResult(prompt_ids=pid, prompt_mask=pm, response_ids=rid, response_mask=rm,
                                rollout_logprobs=lp * rm, temperatures=torch.ones(B, R),
                                finished=torch.ones(B, dtype=torch.bool), texts=texts)


class FakeTask:
    """Renders example i as ``[100 + i, 7]``; a question carrying a reflection (the retry's) as ``[200 + i, 7]``."""

    def __init__(self):
        self.rendered = []

    def render_prompt(self, example, tokenizer):
        self.rendered.append(example.question)
        return [200 + example.index, 7] if "A review of" in example.question else [100 + example.index, 7]


def scorer():
    from rlpost.rewards import Rewards

    def score(rows, texts, lengths):
        r = torch.tensor([1.0 if "X" in t else 0.0 for t in texts])
        return Rewards(r, {"correct": r})

    return score


def make(n=4, **params):
    s = build_sampler(SimpleNamespace(name="r3l", params=params), n)
    s.attach(task=FakeTask(), examples=[Example(index=0, question="Q0", answer="")])
    return s


def test_a_failed_attempt_is_reflected_on_and_retried_from_the_named_step():
    # call 0: two first attempts (n = 4, first_fraction 0.5), both wrong; call 1: the policy's reflections
    # (row 0 names step 1, row 1 names none); call 2: row 0's continuation "\nX" after its prefix "ab"
    eng = ScriptEngine(["ab\ncd\nef", ["cd is wrong.\nRetry from step: 1", "no idea"], "\nX"])
    out = make(4).sample(eng, [[100, 7]], PARAMS, SamplerContext(score=scorer(), prompt_indices=[0]))
    # the reflector's prompt: the problem and the attempt in numbered steps (one user turn; no chat template)
    refl = REFLECTION_PROMPT.format(question="Q0", steps="Step 0: ab\nStep 1: cd\nStep 2: ef", last=2)
    assert eng.calls[1][0] == [[ord(c) for c in refl]] * 2 and eng.calls[1][1].max_new_tokens == 96
    # the retry continues the guided prompt (the reflection in its question) after the kept prefix "ab"
    assert eng.calls[2][0] == [[200, 7, ord("a"), ord("b")]]
    assert eng.calls[2][1].max_new_tokens == 8  # 10 - 2 kept
    # rows: the two attempts, then the retry in their group; the retry is stored under the ORIGINAL prompt
    g = out.generation
    assert out.group_index.tolist() == [0, 0, 0] and out.rewards.tolist() == [0.0, 0.0, 1.0]
    assert g.texts[2] == "ab\nX" and g.prompt_ids[2].tolist() == [100, 7]
    assert g.response_ids[2, :4].tolist() == [ord(c) for c in "ab\nX"]
    # behaviour log-probs: the prefix's from the attempt (-0.1), the suffix's from the guided context (-0.5)
    assert torch.allclose(g.rollout_logprobs[2, :4], torch.tensor([-0.1, -0.1, -0.5, -0.5]))
    # the shared prefix (2 tokens) marked on the retry and on its source attempt; row 1 was not retried
    assert out.extras["r3l_prefix_len"].tolist() == [2, 0, 2]
    assert out.extras["r3l_retried"].tolist() == [0.0, 0.0, 1.0]
    assert out.rollouts_spent == 3
    assert out.metrics == {"sampler/r3l_failed": 2.0, "sampler/r3l_reflections": 2.0, "sampler/r3l_unparsed": 1.0,
                           "sampler/r3l_retried": 1.0, "sampler/r3l_retry_solved": 1.0,
                           "sampler/r3l_prefix_tokens_mean": 2.0, "sampler/r3l_restart_step_mean": 1.0}


def test_the_guided_question_is_what_the_task_renders_for_the_retry():
    s = make(2)
    eng = ScriptEngine(["ab\ncd", "Retry from step: 0", "X"])
    out = s.sample(eng, [[100, 7]], PARAMS, SamplerContext(score=scorer(), prompt_indices=[0]))
    want = GUIDANCE_TEMPLATE.format(question="Q0", reflection="Retry from step: 0")
    assert want in s.task.rendered
    # k = 0: a restart from scratch under the guided prompt, nothing shared, nothing masked
    assert eng.calls[2][0] == [[200, 7]] and out.extras["r3l_prefix_len"].tolist() == [0, 0]
    assert out.generation.texts[1] == "X" and out.generation.prompt_ids[1].tolist() == [100, 7]


def test_max_retries_reflects_again_on_a_failed_retry_and_keeps_the_last():
    # round 1: retry of "ab\ncd" from step 1 gives "ab\nzz" (wrong); round 2: reflect on it, retry from step 1
    eng = ScriptEngine(["ab\ncd", "Retry from step: 1", "\nzz", "Retry from step: 1", "\nX"])
    out = make(2, max_retries=2).sample(eng, [[100, 7]], PARAMS, SamplerContext(score=scorer(), prompt_indices=[0]))
    assert len(eng.calls) == 5 and eng.calls[4][0] == [[200, 7, ord("a"), ord("b")]]
    assert out.generation.texts == ["ab\ncd", "ab\nX"] and out.rewards.tolist() == [0.0, 1.0]
    assert out.extras["r3l_prefix_len"].tolist() == [2, 2] and out.rollouts_spent == 3
    # with one round the failed retry is the group's row
    eng = ScriptEngine(["ab\ncd", "Retry from step: 1", "\nzz"])
    out = make(2).sample(eng, [[100, 7]], PARAMS, SamplerContext(score=scorer(), prompt_indices=[0]))
    assert len(eng.calls) == 3 and out.generation.texts == ["ab\ncd", "ab\nzz"]


def test_successful_attempts_are_not_reflected_on():
    eng = ScriptEngine(["X\nY"])
    out = make(4).sample(eng, [[100, 7]], PARAMS, SamplerContext(score=scorer(), prompt_indices=[0]))
    assert len(eng.calls) == 1 and out.rewards.tolist() == [1.0, 1.0]
    assert out.extras["r3l_prefix_len"].tolist() == [0, 0] and out.metrics["sampler/r3l_failed"] == 0.0


@pytest.mark.parametrize("params,match", [
    ({"first_fraction": 0.0}, "first_fraction=0.0"), ({"max_retries": 0}, "max_retries=0"),
    ({"max_reflection_tokens": 0}, "max_reflection_tokens=0"),
    ({"reflection_prompt": "look at {question}"}, r"reflection_prompt needs the fields \{steps\}"),
    ({"guidance_template": "{question}"}, r"guidance_template needs the fields \{reflection\}"),
    ({"step_pattern": r"step \d+"}, "needs a group"), ({"step_pattern": "("}, "not a regex"),
    ({"segment": "paragraph"}, "paragraph"), ({"max_retry": 2}, "max_retry"),
])
def test_bad_sampler_params_are_config_errors(params, match):
    with pytest.raises(ConfigError, match=match):
        build_sampler(SimpleNamespace(name="r3l", params=params), 4)


# ----------------------------------------------------------------- the update by hand
def _inp(rewards, groups, R=4, prefix=None, retried=None, old=None, rollout=None):
    extras = {}
    if prefix is not None:
        extras["r3l_prefix_len"] = torch.tensor(prefix)
    if retried is not None:
        extras["r3l_retried"] = torch.tensor(retried, dtype=torch.float32)
    B = len(rewards)
    return AdvantageInput(rewards=torch.tensor(rewards), response_mask=torch.ones(B, R),
                          group_index=torch.tensor(groups), extras=extras,
                          old_logprobs=None if old is None else torch.tensor(old),
                          rollout_logprobs=None if rollout is None else torch.tensor(rollout))


def test_positive_amplified_advantages_on_a_small_group_by_hand():
    # group 0: rewards 0.5, 0, 1, 0 -> mean 0.375, r - mean = 0.125, -0.375, 0.625, -0.375
    #   0.5 (above the mean, not a success): 3 * 0.125 = 0.375; the success: 1.0; the rest unchanged -0.375
    # group 1: one success of three -> mean 1/3: the success 1.0 (not 2/3), the failures -1/3
    # group 2: all succeed -> 1.0 each (the release's rule); group 3: all fail -> 0
    r = [0.5, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    g = [0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    a = positive_amplified(torch.tensor(r), torch.tensor(g), positive_weight=3.0, success_threshold=1.0,
                           success_advantage=1.0)
    want = [0.375, -0.375, 1.0, -0.375, -1 / 3, 1.0, -1 / 3, 1.0, 1.0, 0.0, 0.0]
    assert torch.allclose(a, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    out = compute_advantages("r3l", _inp(r, g))
    assert torch.allclose(out.advantages, torch.tensor(want).view(-1, 1).expand(-1, 4), atol=1e-6)
    assert out.loss_mask is None and out.returns is None  # no retry rows: nothing masked
    # norm_by_std (the release's grpo_reweight_adv): unbiased std of group 0 = sqrt(0.6875 / 3) = 0.478714
    s = math.sqrt(0.6875 / 3)
    a = positive_amplified(torch.tensor(r[:4]), torch.tensor(g[:4]), positive_weight=3.0, success_threshold=1.0,
                           success_advantage=1.0, norm_by_std=True)
    assert torch.allclose(a, torch.tensor([3 * 0.125 / s, -0.375 / s, 1.0, -0.375 / s], dtype=torch.float64),
                          atol=1e-6)
    # a group of one: its reward is its advantage (no baseline), amplified when >= 0
    assert positive_amplified(torch.tensor([0.2]), torch.tensor([0]), positive_weight=3.0, success_threshold=1.0,
                              success_advantage=1.0).tolist() == pytest.approx([0.6])


def test_loss_mask_of_a_retried_row_and_its_source_by_hand():
    # rows: a failed attempt (prefix 2 shared with its retry), an unrelated failure, the successful retry
    x = _inp([0.0, 0.0, 1.0], [0, 0, 0], R=5, prefix=[2, 0, 2], retried=[0, 0, 1])
    x.response_mask[1, 4] = 0  # a shorter row
    out = compute_advantages("r3l", x)
    assert out.loss_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    # mean 1/3: the failures -1/3 on their kept tokens, the retry 1.0 on its suffix only
    t = -1 / 3
    want = torch.tensor([[0, 0, t, t, t], [t, t, t, t, 0], [0, 0, 1, 1, 1]])
    assert torch.allclose(out.advantages, want, atol=1e-6)
    assert prefix_keep_mask(torch.ones(2, 3), torch.tensor([0, 3])).tolist() == [[1, 1, 1], [0, 0, 0]]
    # pivotal_mask=false (the release's "w/o credit" ablation): every token trains
    off = compute_advantages("r3l", x, pivotal_mask=False)
    assert off.loss_mask is None and float(off.advantages[2, 0]) == 1.0


def test_off_policy_weight_on_one_retried_row_by_hand():
    # one retried row in its own group (reward 1 -> A = 1), prefix 2 tokens; on the suffix tokens 2, 3:
    # old - rollout = (-1.5) - (-0.5) = -1.0 and (-0.5) - (-0.7) = 0.2 -> mean -0.4 -> w = exp(-0.4) = 0.670320
    # (the prefix's rollout log-probs, -9, are the source attempt's and do not count)
    old, rollout = [[-1.0, -2.0, -1.5, -0.5]], [[-9.0, -9.0, -0.5, -0.7]]
    x = _inp([1.0], [0], prefix=[2], retried=[1], old=old, rollout=rollout)
    out = compute_advantages("r3l", x, retry_is_cap=2.0)
    w = math.exp(-0.4)
    assert torch.allclose(out.advantages, torch.tensor([[0.0, 0.0, w, w]]), atol=1e-6)
    assert float(retry_importance_weight(torch.tensor(old), torch.tensor(rollout),
                                         torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.float64), 2.0)) == \
        pytest.approx(w)
    # truncated at the cap: mean +0.4 -> exp(0.4) = 1.4918 > 1.2
    up = _inp([1.0], [0], prefix=[2], retried=[1], old=[[0.0, 0.0, -0.5, -0.3]], rollout=[[0.0, 0.0, -1.5, -0.1]])
    assert torch.allclose(compute_advantages("r3l", up, retry_is_cap=1.2).advantages[0, 2:], torch.tensor([1.2, 1.2]))
    # the release's default (0): no weight, and a row not retried is never weighted
    assert torch.allclose(compute_advantages("r3l", x).advantages, torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
    first = _inp([1.0], [0], prefix=[2], retried=[0], old=old, rollout=rollout)
    assert torch.allclose(compute_advantages("r3l", first, retry_is_cap=2.0).advantages, torch.tensor([[0., 0., 1., 1.]]))
    with pytest.raises(ValueError, match="needs old_logprobs"):
        compute_advantages("r3l", _inp([1.0], [0], prefix=[2], retried=[1]), retry_is_cap=2.0)


def test_bad_estimator_params():
    x = _inp([1.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match="positive_weight"):
        compute_advantages("r3l", x, positive_weight=-1.0)
    with pytest.raises(ValueError, match="retry_is_cap"):
        compute_advantages("r3l", x, retry_is_cap=-0.5)
    with pytest.raises(ConfigError):
        compute_advantages("r3l", x, positive_weigth=3.0)


def test_preset_recipe_and_the_old_logprob_method(compose):
    from rlpost.config.compose import validate_config
    from rlpost.methods.base import MethodSet

    cfg = compose(["algo=r3l", "sampler=r3l", "model=tiny"])
    validate_config(cfg)
    a = cfg.algo
    assert (a.adv_estimator, a.loss, str(a.loss_params.clip_mode), a.n_samples_per_prompt) == ("r3l", "rec", "none", 8)
    assert "r3l" not in [m.name for m in MethodSet.for_config(cfg).methods]  # release default: no old log-probs pass
    w = compose(["algo=r3l", "model=tiny", "+algo.adv_params.retry_is_cap=2.0"])
    ms = MethodSet.for_config(w)
    assert "r3l" in [m.name for m in ms.methods] and ms.needs().old_logprobs
    r = compose(["+recipe=r3l", "logger=none"])
    assert (r.algo.adv_estimator, r.sampler.name) == ("r3l", "r3l")
    with pytest.raises(ConfigError):
        validate_config(compose(["algo=r3l", "sampler=r3l", "model=tiny", "+sampler.params.max_retry=2"]))


@pytest.mark.usefixtures("one_thread")
def test_r3l_recipe_one_step_on_tiny(compose, tmp_path, monkeypatch):
    """A real step: the random tiny model fails, reflects, and (its reflection read as 'step 1' when the attempt has
    two steps, else 0) is retried; the batch carries the prefix mask and the update is finite."""
    import rlpost.samplers.r3l as mod
    from rlpost.run.runner import Run

    monkeypatch.setattr(mod, "parse_failure_step", lambda text, pattern, n: (1 if n > 1 else 0) if n else None)
    cfg = compose(["+recipe=r3l", *tiny_overrides("steps=1", "eval.at_end=false", "selector.prompts_per_step=2",
                                                  "sampler.params.segment=sentence",
                                                  "sampler.params.max_reflection_tokens=8")])
    run = Run(cfg, tmp_path / "run")
    try:
        c = run.collect(1, run.trainer.version, 0)
        m = run.learn(c)
    finally:
        run.close()
    b = c.batch
    retried = b.extras["r3l_retried"] > 0
    assert m["sampler/r3l_reflections"] > 0
    assert bool(retried.any()) == (m["sampler/r3l_retried"] > 0)
    pre = b.extras["r3l_prefix_len"]
    assert bool((pre[retried] >= 0).all()) and int(pre[~retried].max()) <= int(b.response_mask.shape[1])
    losses = [v for k, v in m.items() if k.startswith("loss/")]
    assert losses and all(math.isfinite(v) for v in losses)
