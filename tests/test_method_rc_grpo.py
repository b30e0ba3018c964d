"""RC-GRPO (arXiv:2602.03025), our reading: the reward-token mix of each group, the tagged prompt (fake and real
tokenizer), stage 1's hindsight labels and its likelihood loss, stage 2's advantage and loss gradient, evaluation
under the high-reward token, bad parameters, and tiny-model steps of both stages."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from fake_engine import FakeEngine, scorer
from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.algos.aggregation import aggregate
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss
from rlpost.algos.rc_grpo import assign_group_tokens, group_token_counts, tagged_question, token_for_reward
from rlpost.core.errors import ConfigError
from rlpost.rollout.base import SamplingParams
from rlpost.samplers import SAMPLERS, SamplerContext
from rlpost.samplers.base import build_sampler
from rlpost.samplers.rc_grpo import ConditionedTask
from rlpost.tasks.base import Example

PARAMS = SamplingParams(max_new_tokens=6, seed=5)
HIGH, LOW = "<|high_reward|>", "<|low_reward|>"


class FakeTask:
    """Renders example i as ``[100 + i, 7]``; under ``<|high_reward|>`` as ``[200 + i, 7]``, ``<|low_reward|>`` ``[300 + i, 7]``."""

    def __init__(self):
        self.cfg = SimpleNamespace(name="fake")
        self.name = "fake"
        self.rendered = []

    def render_prompt(self, example, tokenizer):
        self.rendered.append(example.question)
        base = 200 if example.question.startswith(HIGH + "\n") else 300 if example.question.startswith(LOW + "\n") else 100
        return [base + example.index, 7]

    def score(self, response, example):
        return 1.0


def examples():
    return [Example(index=i, question=q, answer="") for i, q in enumerate(["Calculate 1 + 3.", "Calculate 2 + 2."])]


def make(name, n=4, **kw):
    s = SAMPLERS.get(name)(n, **SAMPLERS.kwargs(name, kw, "sampler.params"))
    s.attach(task=FakeTask(), examples=examples())
    return s


CTX = dict(prompt_indices=[0, 1])


# ----------------------------------------------------------------- the token pieces by hand
def test_group_token_counts_and_assignment_by_hand():
    assert group_token_counts(8, [0.5, 0.5]) == [4, 4]
    assert group_token_counts(3, [0.5, 0.5]) == [2, 1]  # the remainder unit to the better token
    assert group_token_counts(1, [0.5, 0.5]) == [1, 0]
    assert group_token_counts(8, [0.25, 0.75]) == [2, 6]
    assert group_token_counts(5, [1, 1, 1]) == [2, 2, 1]  # 5/3 each: floors 1, 1, 1, remainders tie -> lower index
    assert group_token_counts(0, [1, 1]) == [0, 0]
    assert assign_group_tokens([8, 3], [0.5, 0.5]) == [[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1]]
    g = torch.Generator().manual_seed(0)
    rnd = assign_group_tokens([6, 2, 0], [0.5, 0.5], "random", g)
    assert [len(x) for x in rnd] == [6, 2, 0] and set(sum(rnd, [])) <= {0, 1}
    assert assign_group_tokens([4], [1.0, 0.0], "random", g) == [[0, 0, 0, 0]]  # a zero-weight token is never drawn
    with pytest.raises(ValueError, match="positive sum"):
        group_token_counts(4, [0.0, 0.0])
    with pytest.raises(ValueError, match="balanced, random"):
        assign_group_tokens([4], [1, 1], "uniform")


def test_hindsight_label_and_tagged_question_by_hand():
    assert [token_for_reward(r, [1.0]) for r in (1.0, 1.2, 0.99, 0.0, -1.0)] == [0, 0, 1, 1, 1]
    # three tokens, bounds 1.0 and 0.5: high / middle / low
    assert [token_for_reward(r, [1.0, 0.5]) for r in (1.0, 0.7, 0.5, 0.2)] == [0, 1, 1, 2]
    assert tagged_question("Calculate 2 + 3.", HIGH) == "<|high_reward|>\nCalculate 2 + 3."


def test_the_tag_in_the_real_chat_prompt_is_plain_text():
    """The default task's prompt with the high token, rendered through SmolLM2's chat template (model=tiny)."""
    from rlpost.config.compose import compose_config
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.tasks import build_task

    task = build_task(compose_config(["model=tiny"]).task)
    tok = load_policy(ModelConfig(source="tiny"), seed=0)[1]
    ex = task.eval_examples()[0]
    ids = ConditionedTask(task, HIGH).render_prompt(ex, tok)
    text = tok.decode(ids)
    user = f"<|im_start|>user\n<|high_reward|>\n{ex.question}"
    assert user in text and text.endswith("<|im_start|>assistant\n")
    plain = tok.decode(task.render_prompt(ex, tok))
    assert text == plain.replace(f"<|im_start|>user\n{ex.question}", user)
    # the tag is ordinary tokens (no added special token): more than one id, none of them a special id
    tag_ids = tok(HIGH + "\n", split_special_tokens=True)["input_ids"]
    assert len(tag_ids) > 1 and not set(tag_ids) & set(tok.all_special_ids)


# ----------------------------------------------------------------- stage 2: the sampler on a fake engine
def test_each_group_is_split_over_the_tokens_and_conditioned_on_them():
    # the plain prompt always succeeds (the "paradox of perfection"); under <|low_reward|> it always fails
    eng = FakeEngine({100: 1.0, 101: 1.0, 200: 1.0, 201: 1.0, 300: 0.0, 301: 0.0})
    s = make("rc_grpo", 4)
    out = s.sample(eng, [[100, 7], [101, 7]], PARAMS, SamplerContext(score=scorer(), **CTX))
    # one engine call: per group 2 rollouts under the high token, then 2 under the low token
    assert eng.calls == [[[200, 7]] * 2 + [[300, 7]] * 2 + [[201, 7]] * 2 + [[301, 7]] * 2]
    assert out.group_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and out.rollouts_spent == 8
    assert out.extras["reward_token"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert out.rewards.tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert out.metrics == {"sampler/rc_token0_rows": 4.0, "sampler/rc_token0_reward": 1.0,
                           "sampler/rc_token1_rows": 4.0, "sampler/rc_token1_reward": 0.0,
                           "sampler/rc_mixed_groups_frac": 1.0}
    # the loss sees the token (train_on=conditioned): the prompts are the tagged ones
    assert out.generation.prompt_ids[:, -2].tolist() == [200, 200, 300, 300, 201, 201, 301, 301]
    # stage-2 advantage: GRPO over the whole group [1, 1, 0, 0]: mean 0.5, Bessel std sqrt(1/3) = 0.57735
    inp = AdvantageInput(rewards=out.rewards, response_mask=out.generation.response_mask, group_index=out.group_index)
    adv = compute_advantages("rc_grpo", inp).advantages[:, 0]
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # 0.866024...
    assert torch.allclose(adv, torch.tensor([a, a, -a, -a] * 2), atol=1e-6)
    # the plain group sampler on the same prompts: all rewards 1, the advantage vanishes
    plain = SAMPLERS.get("group")(4).sample(FakeEngine({100: 1.0, 101: 1.0}), [[100, 7], [101, 7]], PARAMS,
                                            SamplerContext(score=scorer(), **CTX))
    rew = torch.tensor([1.0] * 8)
    inp0 = AdvantageInput(rewards=rew, response_mask=plain.generation.response_mask, group_index=plain.group_index)
    assert compute_advantages("rc_grpo", inp0).advantages.abs().sum() == 0


def test_uneven_groups_mix_counts_and_train_on_original():
    eng = FakeEngine({200: 1.0, 300: 0.0})
    s = make("rc_grpo", 3, token_mix=[0.25, 0.75], train_on="original")
    out = s.sample(eng, [[100, 7], [101, 7]], PARAMS, SamplerContext(score=scorer(), **CTX))
    # 3 * [0.25, 0.75] = [0.75, 2.25]: floors [0, 2], the remaining unit to the larger remainder (token 0)
    assert eng.calls == [[[200, 7]] + [[300, 7]] * 2 + [[201, 7]] + [[301, 7]] * 2]
    assert out.extras["reward_token"].tolist() == [0, 1, 1, 0, 1, 1]
    # train_on=original: the loss sees the plain prompt (the token invisible to it)
    assert out.generation.prompt_ids[:, -2].tolist() == [100, 100, 100, 101, 101, 101]
    # the selector's per-prompt allocation is honoured
    eng2 = FakeEngine({})
    out2 = make("rc_grpo", 4).sample(eng2, [[100, 7], [101, 7]], PARAMS,
                                     SamplerContext(score=scorer(), rollout_counts=[2, 1], **CTX))
    assert eng2.calls == [[[200, 7], [300, 7], [201, 7]]] and out2.group_index.tolist() == [0, 0, 1]


def test_random_assignment_is_seeded_by_step():
    s = make("rc_grpo", 8, assign="random")
    a = s.sample(FakeEngine({}), [[100, 7], [101, 7]], PARAMS, SamplerContext(score=scorer(), seed=3, step=1, **CTX))
    b = s.sample(FakeEngine({}), [[100, 7], [101, 7]], PARAMS, SamplerContext(score=scorer(), seed=3, step=1, **CTX))
    assert a.extras["reward_token"].tolist() == b.extras["reward_token"].tolist()
    assert len(a.extras["reward_token"]) == 16 and a.group_index.tolist() == [0] * 8 + [1] * 8


def test_without_a_task_the_tag_ids_go_in_front_of_the_prompt():
    eng = FakeEngine({})
    decode = eng.tokenizer.decode
    eng.tokenizer = SimpleNamespace(encode=lambda t, add_special_tokens=False: [900 + len(t)], decode=decode)
    s = SAMPLERS.get("rc_grpo")(2, **SAMPLERS.kwargs("rc_grpo", {}, "sampler.params"))
    s.sample(eng, [[100, 7]], PARAMS, SamplerContext(score=scorer()))
    # "<|high_reward|>\n" is 16 characters, "<|low_reward|>\n" 15
    assert eng.calls == [[[916, 100, 7], [915, 100, 7]]]


# ----------------------------------------------------------------- stage 1: hindsight labels and the SFT loss
def test_rctp_labels_each_row_with_the_token_of_its_reward():
    eng = FakeEngine({100: 0.5, 101: 0.5})
    s = make("rctp", 8)
    out = s.sample(eng, [[100, 7], [101, 7]], PARAMS, SamplerContext(score=scorer(), **CTX))
    # drawn under the plain prompts (the policy's own samples), then relabelled in hindsight
    assert eng.calls == [[[100, 7]] * 8 + [[101, 7]] * 8]
    r = out.rewards
    assert 0 < float(r.sum()) < 16  # mixed quality at p = 0.5 with this seed
    want_tok = [0 if x >= 1.0 else 1 for x in r.tolist()]
    assert out.extras["reward_token"].tolist() == want_tok
    want_ids = [(200 if t == 0 else 300) + g for t, g in zip(want_tok, out.group_index.tolist())]
    assert out.generation.prompt_ids[:, -2].tolist() == want_ids
    # the SFT labels are the sampled responses themselves, unchanged; only the prompt changed
    assert out.generation.response_mask.sum(-1).tolist() == [6.0] * 16
    assert out.generation.response_ids[:, 0].tolist() == [3 if x >= 1 else 4 for x in r.tolist()]
    n_hi = sum(1 for t in want_tok if t == 0)
    assert out.metrics["sampler/rc_token0_rows"] == n_hi and out.metrics["sampler/rc_token0_reward"] == 1.0
    assert out.metrics["sampler/rc_token1_rows"] == 16 - n_hi and out.metrics["sampler/rc_token1_reward"] == 0.0


def test_rctp_loss_is_the_token_mean_nll_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=mask, group_index=torch.tensor([0, 0]))
    adv = compute_advantages("rctp", inp).advantages
    assert adv.tolist() == mask.tolist()  # weight 1 whatever the reward: the reward only chose the token
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    loss_mat, _ = compute_policy_loss("gpg", PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(), advantages=adv,
                                                             response_mask=mask))
    loss = aggregate("token-mean", loss_mat, mask)
    # (1 + 2 + 0.5 + 0.3 + 0.7) / 5 = 0.9; the padding's -9 never counts
    assert float(loss.detach()) == pytest.approx(0.9)
    loss.backward()
    assert torch.allclose(lp.grad, -mask / 5)


def test_rc_grpo_loss_gradient_by_hand():
    """PPO clip at ratio 1, seq-mean-token-mean: d loss / d log pi_{i,t} = -A_i / (n_seq * len_i)."""
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    rewards = torch.tensor([1.0, 1.0, 0.0])  # tokens high, high, low
    inp = AdvantageInput(rewards=rewards, response_mask=mask, group_index=torch.tensor([0, 0, 0]))
    adv = compute_advantages("rc_grpo", inp).advantages
    # mean 2/3, Bessel std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    a_hi, a_lo = (1 / 3) / (math.sqrt(1 / 3) + 1e-6), (-2 / 3) / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(adv[:, 0], torch.tensor([a_hi, a_hi, a_lo]), atol=1e-6)
    lp = torch.tensor([[-1.0, -0.5], [-0.2, 0.0], [-0.4, -0.8]], requires_grad=True)
    loss_mat, _ = compute_policy_loss("ppo_clip", PolicyLossInput(logprobs=lp, old_logprobs=lp.detach(),
                                                                  advantages=adv, response_mask=mask))
    aggregate("seq-mean-token-mean", loss_mat, mask).backward()
    want = torch.tensor([[-a_hi / 6, -a_hi / 6], [-a_hi / 3, 0.0], [-a_lo / 6, -a_lo / 6]])
    assert torch.allclose(lp.grad, want, atol=1e-6)


# ----------------------------------------------------------------- evaluation and errors
def test_evaluation_conditions_on_the_high_token():
    task = FakeTask()
    for name in ("rctp", "rc_grpo"):
        et = make(name).eval_task(task)
        assert isinstance(et, ConditionedTask) and et.token == HIGH
        assert et.render_prompt(examples()[1], None) == [201, 7]
        assert et.name == "fake" and et.score("x", examples()[0]) == 1.0  # everything else is the task's
    low = make("rc_grpo", eval_token=1).eval_task(task)
    assert low.render_prompt(examples()[0], None) == [300, 7]
    # the other samplers evaluate with the task itself
    assert SAMPLERS.get("group")(4).eval_task(task) is task


@pytest.mark.parametrize("name,params,match", [
    ("rc_grpo", {"token_mix": [1.0]}, "one non-negative weight per token"),
    ("rc_grpo", {"token_mix": [0.0, 0.0]}, "positive sum"),
    ("rc_grpo", {"tokens": ["<|high_reward|>"], "token_mix": [1.0]}, "at least 2 distinct"),
    ("rc_grpo", {"tokens": ["a", "a"]}, "at least 2 distinct"),
    ("rc_grpo", {"eval_token": 2}, "must index tokens"),
    ("rctp", {"reward_bounds": [1.0, 0.5]}, "one bound per token but the last"),
    ("rctp", {"tokens": ["h", "m", "l"], "reward_bounds": [0.5, 1.0]}, "descending"),
])
def test_bad_params_are_config_errors(name, params, match):
    with pytest.raises(ConfigError, match=match):
        build_sampler(SimpleNamespace(name=name, params=params), 4)


def test_misspelt_params_and_a_foreign_sampler_are_config_errors(compose):
    from rlpost.config.compose import validate_config

    with pytest.raises(ConfigError, match="token_mix"):
        validate_config(compose(["model=tiny", "algo=rc_grpo", "+sampler.params.token_mx=[0.5,0.5]"]))
    with pytest.raises(ConfigError, match="sampler=rctp"):
        validate_config(compose(["model=tiny", "algo=rctp", "sampler=group"]))
    # the presets pick their samplers through the estimators' tags
    for algo in ("rctp", "rc_grpo"):
        cfg = compose(["model=tiny", f"algo={algo}"])
        assert cfg.sampler.name == algo and cfg.algo.adv_estimator == algo
    c = compose(["model=tiny", "algo=rctp"]).algo
    assert (c.loss, c.loss_agg, c.n_samples_per_prompt) == ("gpg", "token-mean", 8)


# ----------------------------------------------------------------- the two stages on the tiny model
@pytest.mark.usefixtures("one_thread")
def test_both_stages_step_on_the_tiny_model_and_evaluate_under_the_high_token(tmp_path, monkeypatch):
    import rlpost.run.runner as runner
    from rlpost.config.compose import compose_config

    seen = []
    real = runner.evaluate

    def spy(engine, tokenizer, task, *a, **kw):
        seen.append(task)
        return real(engine, tokenizer, task, *a, **kw)

    monkeypatch.setattr(runner, "evaluate", spy)
    common = ["model=tiny", "steps=1", "logger=jsonl", "selector.prompts_per_step=2", "algo.n_samples_per_prompt=2",
              "rollout.max_new_tokens=6", "checkpoint.every=0", "eval.at_start=false", "eval.limit=2"]
    for algo in ("rctp", "rc_grpo"):
        run_dir = tmp_path / algo
        runner.train(compose_config([f"algo={algo}", *common]), run_dir)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        r = [r for r in rows if "reward/mean" in r][0]
        assert r["step"] == 1 and math.isfinite(r["loss/policy"])
        assert r["sampler/rc_token0_rows"] + r["sampler/rc_token1_rows"] == 4
        if algo == "rc_grpo":  # balanced: one high and one low rollout per prompt
            assert r["sampler/rc_token0_rows"] == r["sampler/rc_token1_rows"] == 2
        assert (run_dir / "eval.json").is_file()
    assert len(seen) == 2 and all(isinstance(t, ConditionedTask) and t.token == HIGH for t in seen)


@pytest.mark.usefixtures("one_thread")
def test_rlpost_eval_of_a_checkpoint_conditions_on_the_high_token(tmp_path, monkeypatch):
    """``rlpost eval sampler=rc_grpo``: the standalone evaluation renders its prompts under ``<|high_reward|>`` too."""
    from typer.testing import CliRunner

    import importlib

    from rlpost.cli import app

    ev = importlib.import_module("rlpost.eval.evaluate")  # the module (rlpost.eval re-exports the function)

    seen = []
    monkeypatch.setattr(ev, "evaluate", lambda engine, tok, task, *a, **kw: seen.append(task) or
                        {"accuracy": 0.0, "ci_low": 0.0, "ci_high": 0.0, "n": 0, "records": []})
    monkeypatch.setattr("rlpost.core.tracking.eval_line", lambda res, what: "eval")
    r = CliRunner().invoke(app, ["eval", "model=tiny", "logger=none", "sampler=rc_grpo", "eval.limit=1",
                                 f"hydra.run.dir={tmp_path}"])
    assert r.exit_code == 0, r.output
    assert len(seen) == 1 and isinstance(seen[0], ConditionedTask) and seen[0].token == HIGH
