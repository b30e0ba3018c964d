"""AgentFlow / Flow-GRPO ("In-the-Flow Agentic System Optimization for Effective Planning and Tool Use",
arXiv:2510.05592): ``sampler=agentflow`` (``env=agentflow``) and ``algo=flow_grpo``.

A scripted two-engine episode (a fake planner engine and a fake fixed engine) checks the module order,
the memory and every module's prompt, that rows hold planner tokens only (the loss mask), and the reward
broadcast; Flow-GRPO's advantages by hand for both normalisations and its identity with ``grpo`` in
the authors' mode; the parsers; the config errors; one training step and the held-out evaluation on the
tiny model with the calculator."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput
from rlpost.algos.registries import ADV_ESTIMATORS
from rlpost.rewards.scoring import Rewards
from rlpost.rollout.base import GenerationResult, SamplingParams
from rlpost.samplers.agentflow import (AgentFlowSampler, AgentMemory, parse_conclusion, parse_plan, planner_prompt,
                                       render_user)
from rlpost.samplers.base import SamplerContext
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy

    return load_policy(compose_config(tiny_overrides()).model, torch.float32, seed=0)[1]


class _Scripted:
    """A fake engine: answers each prompt by the module its text names, from a per-module script;
    records what it was asked (decoded prompt texts) in ``seen``."""

    def __init__(self, tok, script):
        self.tokenizer, self.script, self.seen, self.pad_id = tok, script, [], tok.pad_token_id or 0
        self.eos_ids = {tok.eos_token_id}

    @staticmethod
    def module(text):
        for key, name in (("choose the next step", "planner"), ("analyse the query", "analysis"),
                          ("write the command", "executor"), ("is complete and correct", "verifier"),
                          ("memory is complete", "verifier"), ("give the final answer", "generator")):
            if key in text:
                return name
        raise AssertionError(text)

    def generate(self, prompts, params):
        outs = []
        for p in prompts:
            text = self.tokenizer.decode(p, skip_special_tokens=True)
            m = self.module(text)
            self.seen.append((m, text, list(p)))
            outs.append(self.script[m].pop(0) if isinstance(self.script[m], list) else self.script[m])
        ids = [self.tokenizer(o, add_special_tokens=False)["input_ids"] for o in outs]
        R = max(len(x) for x in ids)
        B = len(ids)
        rid, mask = torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R)
        for i, x in enumerate(ids):
            rid[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        pl = max(len(p) for p in prompts)
        return GenerationResult(torch.zeros(B, pl, dtype=torch.long), torch.ones(B, pl), rid, mask,
                                -0.25 * mask, mask.clone(), torch.ones(B, dtype=torch.bool), outs)


PLAN1 = "Justification: multiply.\nContext: the numbers 12 and 34\nSub-Goal: compute 12 * 34\nTool Name: Calculator"
PLAN2 = "Justification: check.\nContext: 408\nSub-Goal: check it\nTool Name: search_engine"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


def _score(rows, texts, lengths):
    r = torch.tensor([1.0 if "408" in t else 0.0 for t in texts])
    return Rewards(r, {"correct": r})


def _run(tok, script_fixed, script_policy, max_steps=3, n=1):
    s = AgentFlowSampler(n, tools=["calculator"], tool_params=None, max_steps=max_steps, fixed_model="",
                         result_chars=1000, transcripts=False)
    fixed, policy = _Scripted(tok, script_fixed), _Scripted(tok, script_policy)
    s.set_fixed_engine(fixed)
    prompt = render_user(tok, "What is 12 * 34?")
    res = s.sample(policy, [prompt], SamplingParams(max_new_tokens=64, seed=0), SamplerContext(score=_score))
    return s, fixed, policy, res


# ------------------------------------------------------------------ the scripted episode
def test_scripted_episode_memory_prompts_and_module_order(tok):
    fixed_script = {"analysis": "Needs multiplication; the calculator helps.", "executor": [CALL],
                    "verifier": ["Memory lacks a check.\nConclusion: CONTINUE", "All done.\nConclusion: STOP"],
                    "generator": "12 * 34 = 408. The answer is 408."}
    s, fixed, policy, res = _run(tok, fixed_script, {"planner": [PLAN1, PLAN2]})
    # module order: analysis, (planner, executor, verifier) for step 1, (planner, verifier) for step 2 (no tool
    # named: no executor), then the verifier's STOP ends the loop before step 3, then the generator
    order = [m for m, _, _ in fixed.seen]
    assert order == ["analysis", "executor", "verifier", "verifier", "generator"]
    assert [m for m, _, _ in policy.seen] == ["planner", "planner"]  # the policy only ever plans
    # the planner's first prompt: query, analysis, tools, empty memory, step 1 of 3
    p1, p2 = policy.seen[0][1], policy.seen[1][1]
    assert "What is 12 * 34?" in p1 and "Needs multiplication" in p1 and "calculator" in p1
    assert "Previous steps: {}" in p1 and "Step 1 of 3" in p1
    # the memory after step 1 holds (tool, sub-goal, command, result), and the step-2 planner reads it
    mem1 = {"Action Step 1": {"tool_name": "calculator", "sub_goal": "compute 12 * 34", "command": CALL, "result": "408"}}
    assert json.dumps(mem1) in p2 and "Step 2 of 3" in p2
    # the executor got the planner's sub-goal, tool and context
    ex = fixed.seen[1][1]
    assert "Sub-goal: compute 12 * 34" in ex and "Tool: calculator" in ex and "Context: the numbers 12 and 34" in ex
    # step 2 named no available tool: recorded, nothing run; verifier and generator read the full memory
    ver2, gen = fixed.seen[3][1], fixed.seen[4][1]
    assert '"Action Step 2": {"tool_name": null, "sub_goal": "check it"' in ver2
    assert "No result: no tool was run." in gen and '"result": "408"' in gen
    assert res.metrics["agentflow/invalid_tool_rate"] == 0.5 and res.metrics["agentflow/verifier_stop_frac"] == 1.0
    assert res.extras["episode_tool_calls"].tolist() == [1.0, 1.0]


def test_rows_hold_planner_tokens_only_and_the_outcome_is_broadcast(tok):
    fixed_script = {"analysis": "Analysis.", "executor": [CALL] * 3, "verifier": "Conclusion: CONTINUE",
                    "generator": "The answer is 408."}
    s, fixed, policy, res = _run(tok, fixed_script, {"planner": [PLAN1, PLAN1, PLAN1]}, max_steps=3)
    g = res.generation
    assert g.response_ids.shape[0] == 3 == res.rollouts_spent * 3  # one episode, one row per planner turn
    # the verifier is not asked at the cap (t = max_steps): 2 verifier calls for 3 planner turns
    assert [m for m, _, _ in fixed.seen].count("verifier") == 2
    want = tok(PLAN1, add_special_tokens=False)["input_ids"]
    for i in range(3):
        n = int(g.response_mask[i].sum())
        assert g.response_ids[i, :n].tolist() == want  # the planner's sampled ids, exactly
        assert g.response_mask[i, :n].eq(1).all() and g.response_mask[i, n:].eq(0).all()
        assert torch.allclose(g.rollout_logprobs[i, :n], torch.full((n,), -0.25))
        # the row's prompt is that turn's planner prompt (memory as it stood), left-padded
        prompt = policy.seen[i][2]
        assert g.prompt_ids[i, g.prompt_mask[i].bool()].tolist() == prompt
    # no fixed-module output is in any row: the loss mask covers planner tokens only
    texts = [tok.decode(g.response_ids[i, g.response_mask[i].bool()].tolist()) for i in range(3)]
    assert all("tool_call" not in t and "Conclusion" not in t and "answer is" not in t for t in texts)
    # the episode's one outcome on every turn row; the last row marks the episode for evaluation
    assert res.rewards.tolist() == [1.0, 1.0, 1.0] and res.extras["reward_correct"].tolist() == [1.0, 1.0, 1.0]
    assert res.extras["flow_turn"].tolist() == [0, 1, 2] and res.extras["episode_final_row"].tolist() == [False, False, True]
    from rlpost.eval.episodes import _one_row_per_episode

    one = _one_row_per_episode(res)
    assert one.generation.response_ids.shape[0] == 1 and one.rewards.tolist() == [1.0]
    assert one.extras["episode_turns"].tolist() == [3.0]


def test_memory_truncates_results():
    m = AgentMemory(result_chars=5)
    m.add(1, "calculator", "g", "c", "1234567890")
    assert m.actions["Action Step 1"]["result"] == "12345...(truncated)" and len(m) == 1
    assert "Previous steps: " + m.render() in planner_prompt("q", "a", {}, m, 2, 3)


# ------------------------------------------------------------------ parsers (the authors' rules)
def test_parse_plan_and_conclusion():
    assert parse_plan(PLAN1, ["calculator"]) == ("the numbers 12 and 34", "compute 12 * 34", "calculator")
    # markup removed, the last block wins, spaces/underscores/case normalised
    text = "**Context:** a\n**Sub-Goal:** b\n**Tool Name:** x\n\nContext: c\nSub-Goal: d\nTool Name: Python  Tool"
    assert parse_plan(text, ["calculator", "python_tool"]) == ("c", "d", "python_tool")
    assert parse_plan("no plan here", ["calculator"]) == (None, None, None)
    assert parse_plan(PLAN2, ["calculator"])[2] is None
    assert parse_conclusion("x\nConclusion: STOP") == "STOP"
    assert parse_conclusion("Conclusion: STOP ... **Conclusion**: CONTINUE") == "CONTINUE"
    assert parse_conclusion("we should stop here") == "STOP"  # the authors' fallback
    assert parse_conclusion("keep going") == "CONTINUE"


# ------------------------------------------------------------------ Flow-GRPO's advantages by hand
def _inp(rewards, groups, episodes, lens=(2,) * 8):
    B = len(rewards)
    mask = torch.zeros(B, 3)
    for i in range(B):
        mask[i, : lens[i]] = 1
    return AdvantageInput(rewards=torch.tensor(rewards), response_mask=mask, group_index=torch.tensor(groups),
                          extras={"flow_episode": torch.tensor(episodes)})


def test_flow_grpo_by_hand_both_normalisations():
    fn = ADV_ESTIMATORS.get("flow_grpo")
    # group 0: episode 0 (2 turns, R=1), episode 1 (1 turn, R=0), episode 2 (3 turns, R=0);
    # group 1: episodes 3, 4 both R=1 (zero variance)
    r = [1, 1, 0, 0, 0, 0, 1, 1, 1]
    g = [0, 0, 0, 0, 0, 0, 1, 1, 1]
    e = [0, 0, 1, 2, 2, 2, 3, 3, 4]
    inp = _inp([float(x) for x in r], g, e, lens=(2, 1, 2, 2, 2, 1, 2, 2, 2))
    # turn rows (authors' code): mean 1/3 over 6 rows, unbiased std sqrt((2 (2/3)^2 + 4 (1/3)^2) / 5) = sqrt(4/15)
    std = math.sqrt(4 / 15)
    a = fn(inp, normalize_over="turn", norm_by_std=True, eps=0.0).advantages
    assert a[0, :2].tolist() == pytest.approx([(2 / 3) / std] * 2) and a[1, 0] == pytest.approx((2 / 3) / std)
    assert a[2, :2].tolist() == pytest.approx([-(1 / 3) / std] * 2) and a[1, 1] == 0 and a[5, 1] == 0
    assert a[6:].abs().sum() == 0
    # episodes (paper's text): R = (1, 0, 0), mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    b = fn(inp, normalize_over="episode", norm_by_std=True, eps=0.0).advantages
    assert b[0, 0] == pytest.approx((2 / 3) / s) and b[1, 0] == pytest.approx((2 / 3) / s)
    assert b[2, 0] == pytest.approx(-(1 / 3) / s) and b[3, 0] == pytest.approx(-(1 / 3) / s) and b[5, 0] == pytest.approx(-(1 / 3) / s)
    assert b[6:].abs().sum() == 0 and b[1, 1] == 0
    # every turn of an episode gets the same advantage (the broadcast)
    assert b[3, 0] == b[4, 0] == b[5, 0]
    c = fn(inp, normalize_over="episode", norm_by_std=False, eps=1e-6).advantages
    assert c[0, 0] == pytest.approx(2 / 3) and c[2, 0] == pytest.approx(-1 / 3)


def test_flow_grpo_turn_mode_is_grpo_and_errors():
    torch.manual_seed(0)
    fn, grpo = ADV_ESTIMATORS.get("flow_grpo"), ADV_ESTIMATORS.get("grpo")
    inp = _inp(torch.rand(8).tolist(), [0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 2, 3, 3, 4, 5])
    a = fn(inp, normalize_over="turn", norm_by_std=True, eps=1e-6).advantages
    b = grpo(inp, norm_by_std=True, eps=1e-6, baseline="mean", unbiased_std=True, std_scope="group").advantages
    assert torch.equal(a, b)
    # single-turn rows (no flow_episode): each row is its own episode, so episode mode is grpo too
    plain = AdvantageInput(rewards=inp.rewards, response_mask=inp.response_mask, group_index=inp.group_index)
    assert torch.allclose(fn(plain, normalize_over="episode", norm_by_std=True, eps=1e-6).advantages, b)
    with pytest.raises(ValueError, match="share its reward"):
        fn(_inp([1.0, 0.0], [0, 0], [0, 0]), normalize_over="episode", norm_by_std=True, eps=1e-6)
    with pytest.raises(ValueError, match="normalize_over"):
        fn(inp, normalize_over="trajectory", norm_by_std=True, eps=1e-6)


# ------------------------------------------------------------------ config errors
def test_config_errors(compose, tok):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError
    from rlpost.samplers.base import build_sampler

    ok = compose(tiny_overrides("env=agentflow", "algo=flow_grpo"))
    assert ok.sampler.name == "agentflow" and ok.algo.adv_estimator == "flow_grpo"
    assert build_sampler(ok.sampler, 4).max_steps == 3
    with pytest.raises(ConfigError, match="max_step"):
        validate_config(compose(tiny_overrides("env=agentflow", "+sampler.params.max_step=2")))
    with pytest.raises(ConfigError, match="normalize_ove"):
        validate_config(compose(tiny_overrides("algo=flow_grpo", "+algo.adv_params.normalize_ove=turn")))
    for over, msg in [("sampler.params.max_steps=0", "max_steps"), ("sampler.params.tools=[abacus]", "abacus"),
                      ("sampler.params.tools=[]", "at least one tool"), ("sampler.params.result_chars=0", "result_chars")]:
        cfg = compose(tiny_overrides("env=agentflow", over))
        with pytest.raises(ConfigError, match=msg):
            build_sampler(cfg.sampler, 4)
    # estimators that match turns inside an episode's row have nothing to match in one-row-per-turn batches
    from rlpost.methods.base import MethodSet

    with pytest.raises(ConfigError, match="one row per turn"):
        MethodSet.for_config(compose(tiny_overrides("env=agentflow", "algo=hgpo")))
    with pytest.raises(ConfigError, match="sampler=group"):
        validate_config(compose(tiny_overrides("env=agentflow", "executor.partial_rollout=true")))
    with pytest.raises(ConfigError, match="fixed_model=<model preset"):
        validate_config(compose(tiny_overrides("env=agentflow", "rollout=vllm")))
    validate_config(compose(tiny_overrides("env=agentflow", "rollout=vllm", "sampler.params.fixed_model=policy")))
    s = build_sampler(ok.sampler, 4)

    class _NoModel:
        tokenizer = tok

    with pytest.raises(ConfigError, match="fixed_model"):
        s.fixed_engine(_NoModel())


# ------------------------------------------------------------------ the tiny model: a frozen fixed engine, one step
def test_fixed_engine_is_a_frozen_copy_of_the_starting_policy(tok):
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine

    policy = load_policy(compose_config(tiny_overrides()).model, torch.float32, seed=0)[0]
    eng = HFRolloutEngine(policy, tok, batch_size=8)
    s = AgentFlowSampler(2, tools=["calculator"], tool_params=None, max_steps=2, fixed_model="", result_chars=100,
                         transcripts=False)
    fixed = s.fixed_engine(eng)
    assert fixed is not eng and fixed.model is not policy and s.fixed_engine(eng) is fixed
    w = next(policy.parameters())
    before = next(fixed.model.parameters()).clone()
    with torch.no_grad():
        w.add_(1.0)  # the policy moves; the fixed modules' weights do not
    assert torch.equal(next(fixed.model.parameters()), before)
    assert not any(p.requires_grad for p in fixed.model.parameters())
    assert AgentFlowSampler(1, tools=["calculator"], tool_params=None, max_steps=1, fixed_model="policy",
                            result_chars=10, transcripts=False).fixed_engine(eng) is eng
    loaded = AgentFlowSampler(1, tools=["calculator"], tool_params=None, max_steps=1, fixed_model="tiny",
                              result_chars=10, transcripts=False).fixed_engine(eng)  # a model preset, loaded frozen
    assert loaded is not eng and loaded.model is not policy and not any(p.requires_grad for p in loaded.model.parameters())


def test_one_step_on_the_tiny_model_with_the_calculator(compose, tmp_path, monkeypatch):
    from rlpost.run.runner import train

    orig = AgentFlowSampler._assemble

    def mixed(self, flows, engine, ctx):  # the random tiny model never answers: give even episodes reward 1
        res = orig(self, flows, engine, ctx)
        if len(flows) > 2:  # training steps only (evaluation: one episode per problem)
            res.rewards = (res.extras["flow_episode"] % 2 == 0).float()
        return res

    monkeypatch.setattr(AgentFlowSampler, "_assemble", mixed)
    cfg = compose(tiny_overrides("env=agentflow", "algo=flow_grpo", "task=multiply", "steps=1", "algo.n_samples_per_prompt=2",
                                 "selector.prompts_per_step=2", "sampler.params.max_steps=2", "eval.at_end=true",
                                 "eval.limit=2", "eval.every=0"))
    train(cfg, tmp_path / "t")
    rows = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in rows if "agentflow/planner_turns_mean" in r)
    turns = m["agentflow/planner_turns_mean"]
    assert 1.0 <= turns <= 2.0 and m["rollout/batch_rows"] == 4 * turns  # 2 prompts x 2 episodes, a row per turn
    assert m["actor/grad_norm"] > 0 and math.isfinite(m["loss/policy"])  # the planner rows train
    tr = json.loads(next((tmp_path / "t" / "transcripts").glob("step_*.json")).read_text())
    mods = [x["module"] for x in tr["transcript"]]
    assert mods[0] == "analysis" and mods[-1] == "generator" and "planner" in mods
    ev = json.loads((tmp_path / "t" / "eval.json").read_text())
    assert "accuracy" in json.dumps(ev)


def test_resumed_run_keeps_the_starting_policy_as_the_fixed_modules(compose, tmp_path):
    """fixed_model='': the copy is taken when the run is built, before a checkpoint's weights are loaded."""
    from rlpost.run.runner import Run

    cfg = compose(tiny_overrides("env=agentflow", "algo=flow_grpo", "task=multiply", "steps=1"))
    start = Run(cfg, tmp_path / "a")
    w0 = next(start.sampler.fixed.model.parameters()).detach().clone()
    with torch.no_grad():
        next(start.trainer.policy.parameters()).add_(1.0)  # "trained" weights, as a checkpoint would restore them
    assert torch.equal(next(start.sampler.fixed.model.parameters()), w0)
    again = Run(cfg, tmp_path / "b")  # a fresh build (as at resume, before restore) copies the starting weights
    assert torch.equal(next(again.sampler.fixed.model.parameters()), w0)
