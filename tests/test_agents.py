"""Multi-turn episodes: tool-call parsing, tools, the sandbox under hostile code, token-exact
trajectories, single-turn parity, SAO's targets across turns, and one real step."""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlpost.envs.sandbox import SandboxLimits, run_python
from rlpost.envs.tools import Calculator, PythonTool, call_tool, parse_tool_calls, safe_arithmetic
from rlpost.rollout.base import GenerationResult, RolloutEngine
from rlpost.samplers.base import SamplerContext, SamplingParams
from rlpost.samplers.episode import EpisodeSampler, render_insert
from tests.conftest import tiny_overrides

ROOT = os.geteuid() == 0


# ------------------------------------------------------------------ parsing and tools
def test_parse_tool_calls_valid_malformed_and_none():
    ok = parse_tool_calls('x <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    assert len(ok) == 1 and ok[0].name == "calculator" and ok[0].arguments == {"expression": "2*3"} and ok[0].error is None
    as_str = parse_tool_calls('<tool_call>{"name": "c", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert as_str[0].arguments == {"a": 1}
    bad = parse_tool_calls("<tool_call>{name: calculator}</tool_call>")
    assert bad[0].error.startswith("Error: tool call is not valid JSON")
    assert parse_tool_calls("<tool_call>[1, 2]</tool_call>")[0].error.startswith("Error: a tool call must be")
    assert parse_tool_calls('<tool_call>{"name": "c", "arguments": 3}</tool_call>')[0].error.endswith("JSON object.")
    unclosed = parse_tool_calls('<tool_call>{"name": "c", "arguments": {}}')  # cut at max tokens: still parsed
    assert unclosed[0].name == "c"
    assert parse_tool_calls("The answer is 42.") == []


def test_calculator_values_and_errors():
    assert safe_arithmetic("123 * 456") == 56088
    assert safe_arithmetic("(2 + 3) ** 2 - 7 // 2") == 22
    assert Calculator()(expression="10 / 4").content == "2.5"
    assert Calculator()(expression="8 / 4").content == "2"
    for expr, msg in [("__import__('os')", "unsupported syntax"), ("1/0", "division by zero"),
                      ("2 ** 100000", "exponent too large"), ("1 +", "cannot parse")]:
        r = Calculator()(expression=expr)
        assert r.error and msg in r.content
    assert Calculator()(expr="1").error  # wrong argument name: an error message, not an exception
    unknown = call_tool({"calculator": Calculator()}, parse_tool_calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>')[0])
    assert unknown.error and "unknown tool 'rm'" in unknown.content


# ------------------------------------------------------------------ the sandbox against hostile code
LIM = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, output_bytes=4096, nproc=16)


def test_sandbox_runs_code_and_reports_stdout():
    r = run_python("print(sum(range(10)))", LIM)
    assert r.ok and r.stdout == "45\n" and r.message() == "45\n"


@pytest.mark.parametrize("name,code,expect", [
    ("infinite loop", "while True:\n    pass", ("CPU time limit", "timed out")),
    ("10 GB allocation", "x = bytearray(10 * 1024 ** 3)\nprint('allocated')", ("MemoryError",)),
    ("100 MB print", "import sys\nsys.stdout.write('a' * 100_000_000)", ("output limit exceeded",)),
    ("sleep past the wall clock", "import time\ntime.sleep(60)", ("timed out",)),
])
def test_sandbox_limits_end_hostile_code_with_an_error_message(name, code, expect):
    r = run_python(code, LIM)
    assert not r.ok, name
    assert any(e in r.message() for e in expect), (name, r.message())
    assert r.seconds < LIM.wall_s + 2
    assert len(r.stdout) <= LIM.output_bytes


def test_sandbox_fork_bomb_is_bounded_and_killed():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = run_python(code, LIM)
    assert not r.ok and ("timed out" in r.message() or "CPU time" in r.message())
    # the process group is gone: no process of the sandbox user is left
    if ROOT:
        import subprocess

        left = subprocess.run(["pgrep", "-u", "nobody", "-f", "main.py"], capture_output=True, text=True).stdout
        assert left.strip() == ""


@pytest.mark.skipif(not ROOT, reason="network namespaces need root (documented in docs/AGENTS.md)")
def test_sandbox_has_no_network():
    code = "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('1.1.1.1', 80))\nprint('connected')"
    r = run_python(code, LIM)
    assert r.network_isolated and not r.ok and "connected" not in r.stdout
    assert "Network is unreachable" in r.message()


@pytest.mark.skipif(not ROOT, reason="dropping to `nobody` needs root (documented in docs/AGENTS.md)")
def test_sandbox_cannot_write_outside_its_directory(tmp_path):
    target = os.path.join(os.path.dirname(__file__), "SANDBOX_ESCAPE")
    r = run_python(f"open({target!r}, 'w').write('x')\nprint('wrote')", LIM)
    assert not r.ok and "PermissionError" in r.message() and not os.path.exists(target)
    own = run_python("open('scratch.txt', 'w').write('x')\nprint(open('scratch.txt').read())", LIM)
    assert own.ok and own.stdout == "x\n"  # its own throw-away directory is writable


def test_python_tool_returns_errors_as_messages():
    tool = PythonTool(wall_s=3.0, cpu_s=2)
    assert tool(code="print(6 * 7)").content == "42\n"
    r = tool(code="raise ValueError('boom')")
    assert r.error and r.content == "Error: ValueError: boom"
    assert tool(source="x").error  # wrong argument: an error message


# ------------------------------------------------------------------ token-exact trajectories
@pytest.fixture(scope="module")
def tok():
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_tokenizer

    return load_tokenizer(compose_config(tiny_overrides()).model)


class ScriptedEngine(RolloutEngine):
    """Emits scripted turns (token ids) per call and records what it was prompted with."""

    def __init__(self, tok, turns):
        self.tokenizer, self.pad_id, self.eos_ids = tok, tok.pad_token_id, {tok.eos_token_id}
        self.turns, self.calls = turns, []

    def generate(self, prompts, params):
        from rlpost.rollout.hf import left_pad

        k = len(self.calls)
        self.calls.append([list(p) for p in prompts])
        outs = [self.turns[k] for _ in prompts]
        R = max(len(o) for o in outs)
        ids = torch.full((len(outs), R), self.pad_id)
        mask, lp = torch.zeros(len(outs), R), torch.zeros(len(outs), R)
        for i, o in enumerate(outs):
            ids[i, : len(o)] = torch.tensor(o)
            mask[i, : len(o)] = 1
            lp[i, : len(o)] = -0.1 * (k + 1) - 0.01 * torch.arange(len(o))
        p_ids, p_mask = left_pad(prompts, self.pad_id)
        return GenerationResult(p_ids, p_mask, ids, mask, lp, mask.clone(), torch.ones(len(outs), dtype=torch.bool),
                                [self.tokenizer.decode(o, skip_special_tokens=True) for o in outs])

    def sync_weights(self, policy):
        pass


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_render_insert_uses_the_chat_template_and_skips_the_sampled_end_of_turn(tok):
    msgs = [{"role": "tool", "content": "56088"}]
    assert render_insert(tok, msgs, after_eos=True) == _ids(tok, "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n")
    # a turn that stopped at </tool_call> gets the end-of-turn token inserted (no loss on it)
    assert render_insert(tok, msgs, after_eos=False) == _ids(tok, "<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n")


def test_three_turn_episode_is_token_exact_and_masks_exactly_the_model_tokens(tok):
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'
    t1 = _ids(tok, "Let me compute. " + call)  # stopped at </tool_call>: no EOS sampled
    t2 = _ids(tok, call) + [tok.eos_token_id]  # ended with EOS
    t3 = _ids(tok, "The answer is 56088") + [tok.eos_token_id]
    eng = ScriptedEngine(tok, [t1, t2, t3])
    prompt = _ids(tok, "<|im_start|>user\nWhat is 123*456?<|im_end|>\n<|im_start|>assistant\n")
    s = EpisodeSampler(1, max_turns=4, max_total_tokens=1000)
    res = s.sample(eng, [prompt], SamplingParams(max_new_tokens=64, seed=1), SamplerContext(step=1))
    ins1 = _ids(tok, "<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n")
    ins2 = _ids(tok, "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n")
    expect = t1 + ins1 + t2 + ins2 + t3
    g = res.generation
    n = int(len(expect))
    assert g.response_ids[0, :n].tolist() == expect
    assert g.response_mask[0, :n].tolist() == [1.0] * len(t1) + [0.0] * len(ins1) + [1.0] * len(t2) + [0.0] * len(ins2) + [1.0] * len(t3)
    # rollout log-probs: the engine's on model tokens, 0 on inserted text
    lp = g.rollout_logprobs[0]
    assert torch.allclose(lp[: len(t1)], -0.1 - 0.01 * torch.arange(len(t1)))
    assert lp[len(t1): len(t1) + len(ins1)].abs().sum() == 0
    off = len(t1) + len(ins1) + len(t2) + len(ins2)
    assert torch.allclose(lp[off:n], -0.3 - 0.01 * torch.arange(len(t3)))
    # each turn was prompted with exactly prompt + everything so far (nothing re-tokenised)
    assert eng.calls[1][0] == prompt + t1 + ins1 and eng.calls[2][0] == prompt + t1 + ins1 + t2 + ins2
    assert g.texts == ["The answer is 56088"] and bool(g.finished[0])
    assert res.metrics["episode/turns_mean"] == 3 and res.metrics["episode/tool_calls_mean"] == 2
    assert res.metrics["episode/tool_error_rate"] == 0 and res.metrics["episode/truncated_frac"] == 0
    assert res.extras["episode_turns"].tolist() == [3.0]


def test_bad_tool_calls_cost_the_episode_never_the_run(tok):
    bad = [_ids(tok, "<tool_call>{oops</tool_call>"),
           _ids(tok, '<tool_call>{"name": "shell", "arguments": {"cmd": "rm -rf /"}}</tool_call>'),
           _ids(tok, '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>')]
    bad.append(bad[0])  # the 4th turn, at the turn cap, calls again: that call is never executed
    eng = ScriptedEngine(tok, bad)
    s = EpisodeSampler(1, env_params={"tools": ["calculator", "python"], "tool_params": {"python": {"wall_s": 1.0, "cpu_s": 5}}},
                       max_turns=4, max_total_tokens=1000)
    res = s.sample(eng, [[1, 2, 3]], SamplingParams(max_new_tokens=64), SamplerContext(step=1))
    m = res.metrics
    assert m["episode/tool_calls_mean"] == 3 and m["episode/tool_error_rate"] == 1.0
    assert m["episode/tool_timeout_rate"] == pytest.approx(1 / 3) and m["episode/truncated_frac"] == 1.0  # out of turns
    assert m["episode/tool_calls_skipped_mean"] == 1
    assert not bool(res.generation.finished[0])


def test_token_budget_truncates_before_inserting_environment_text(tok):
    call = _ids(tok, '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    eng = ScriptedEngine(tok, [call, call])
    s = EpisodeSampler(1, max_turns=4, max_total_tokens=len(call) + 3)  # no room for the tool message
    res = s.sample(eng, [[5, 6]], SamplingParams(max_new_tokens=64), SamplerContext(step=1))
    assert res.generation.response_mask[0].tolist() == [1.0] * len(call)
    assert res.metrics["episode/truncated_frac"] == 1.0 and len(eng.calls) == 1


# ------------------------------------------------------------------ parity with single-turn rollouts
def test_episode_without_tool_calls_equals_single_turn_rollout_bit_for_bit(compose):
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.samplers.base import SingleSampler

    cfg = compose(tiny_overrides())
    policy, tk = load_policy(cfg.model, torch.float32, seed=0)
    eng = HFRolloutEngine(policy, tk, batch_size=3)
    prompts = [_ids(tk, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), _ids(tk, "what is 2+2?"), [7, 8, 9, 10]]
    sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=1234)
    a = SingleSampler(1).sample(eng, prompts, sp, SamplerContext(step=1, seed=5))
    b = EpisodeSampler(1, max_turns=3, max_total_tokens=64).sample(eng, prompts, sp, SamplerContext(step=1, seed=5))
    assert b.metrics["episode/tool_calls_mean"] == 0 and b.metrics["episode/turns_mean"] == 1
    for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logprobs", "temperatures", "finished"):
        x, y = getattr(a.generation, f), getattr(b.generation, f)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f
    assert a.generation.texts == b.generation.texts and torch.equal(a.group_index, b.group_index)


# ------------------------------------------------------------------ SAO across turns
def test_sao_value_targets_across_a_three_turn_episode_hand_computed():
    from rlpost.algos.advantages import AdvantageInput, compute_advantages

    # turn 1: tokens 0-1, tool text 2-3, turn 2: token 4, tool text 5, turn 3: tokens 6-7; then padding
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    v = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4, 9.0, 0.6, 0.7, 9.0]])
    inp = AdvantageInput(rewards=torch.tensor([1.0]), response_mask=mask, group_index=torch.tensor([0]), values=v)
    out = compute_advantages("sao", inp, gamma=1.0, lam=1.0, whiten=False)
    model = [0, 1, 4, 6, 7]
    assert torch.allclose(out.returns[0, model], torch.ones(5))  # Monte-Carlo return R on every model token
    assert torch.allclose(out.advantages[0, model], 1 - v[0, model])
    assert out.advantages[0, [2, 3, 5, 8]].abs().sum() == 0 and out.returns[0, [2, 3, 5, 8]].abs().sum() == 0
    # lam = 0.5: the next state of token 1 is token 4 (tool text is part of the transition)
    out = compute_advantages("sao", inp, gamma=1.0, lam=0.5, whiten=False)
    # deltas 0.1, 0.2, 0.2, 0.1, 0.3 on tokens 0, 1, 4, 6, 7; A_t = delta_t + 0.5 A_next
    assert torch.allclose(out.advantages[0, model], torch.tensor([0.28125, 0.3625, 0.325, 0.25, 0.3]))
    assert torch.allclose(out.returns[0, model], torch.tensor([0.38125, 0.5625, 0.725, 0.85, 1.0]))
    # gamma = 0.5 discounts per model token, not per position
    out = compute_advantages("sao", inp, gamma=0.5, lam=1.0, whiten=False)
    assert torch.allclose(out.returns[0, model], torch.tensor([0.0625, 0.125, 0.25, 0.5, 1.0]))


def test_outcome_reward_sits_on_the_last_model_token_not_at_mask_sum():
    from rlpost.algos.advantages import AdvantageInput, outcome_token_rewards

    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.float32)
    tr = outcome_token_rewards(AdvantageInput(rewards=torch.tensor([2.0, 3.0]), response_mask=mask,
                                              group_index=torch.tensor([0, 1])))
    assert tr.tolist() == [[0, 0, 0, 2.0, 0], [0, 0, 3.0, 0, 0]]


# ------------------------------------------------------------------ Gymnasium adapter
def test_gymnasium_frozenlake_runs_unchanged_through_the_adapter():
    pytest.importorskip("gymnasium")
    from rlpost.envs import make_env
    from rlpost.tasks.base import Example

    env = make_env("gymnasium", {"env_id": "FrozenLake-v1", "env_kwargs": {"is_slippery": False}})
    obs = env.reset(Example(0, "", None))
    assert obs.startswith("SFFF") and "<action>N</action>" in obs
    assert env.step("no idea").info["tool_errors"] == 1  # an invalid action is an error message, not a crash
    rewards = [env.step(f"I go <action>{a}</action>") for a in (2, 2, 1, 1, 1, 2)]  # right right down down down right
    assert [s.done for s in rewards] == [False] * 5 + [True] and rewards[-1].reward == 1.0


# ------------------------------------------------------------------ one real step on episodes
@pytest.mark.parametrize("algo", ["sao", "grpo"])
def test_one_training_step_on_episodes_logs_episode_metrics_and_a_transcript(compose, tmp_path, algo):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides(f"algo={algo}", "env=calculator", "task=multiply", "steps=1", "eval.at_end=false",
                                 "eval.every=0", "sampler.params.max_total_tokens=40", "checkpoint.every=0"))
    train(cfg, tmp_path / algo)
    rows = [json.loads(x) for x in (tmp_path / algo / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in rows if "episode/turns_mean" in r)
    for k in ("episode/tool_calls_mean", "episode/tool_error_rate", "episode/tool_timeout_rate",
              "episode/truncated_frac", "episode/env_seconds"):
        assert k in m
    assert m["episode/turns_mean"] >= 1
    tr = json.loads((tmp_path / algo / "transcripts" / "step_000001.json").read_text())
    assert tr["step"] == 1 and tr["transcript"][0]["role"] == "assistant"


def test_held_out_evaluation_runs_episodes_and_branching_partial_rollouts_are_refused(compose, tmp_path):
    from rlpost.core.errors import ConfigError
    from rlpost.run.runner import Run

    run = Run(compose(tiny_overrides("env=calculator", "task=multiply", "eval.limit=3", "sampler.params.max_total_tokens=30")),
              tmp_path / "r")
    try:
        m, res = run.evaluate()
    finally:
        run.close()
    assert res["n"] == 3 and len(res["records"]) == 3 and 0 <= m["eval/accuracy"] <= 1
    assert "eval/multiply/tool_call_frac" in m and m["eval/multiply/turns_mean"] >= 1
    # the same bootstrap CI as single-turn evaluation, over the episodes' correct flags
    from rlpost.eval.stats import bootstrap_ci

    ci = bootstrap_ci([float(r["correct"]) for r in res["records"]], n_boot=1000, seed=run.cfg.seed)
    assert (res["ci_low"], res["ci_high"]) == (ci["ci_low"], ci["ci_high"])
    assert res["ci_low"] <= res["accuracy"] <= res["ci_high"]
    with pytest.raises(ConfigError, match="without branching"):
        Run(compose(tiny_overrides("env=calculator", "executor.partial_rollout=true", "sampler.params.branching=arpo")),
            tmp_path / "p")
    with pytest.raises(ConfigError, match="env_reward_at=turn"):
        Run(compose(tiny_overrides("env=calculator", "executor.partial_rollout=true",
                                   "sampler.params.env_reward_weight=1.0")), tmp_path / "q")


def test_void_turn_filter_keeps_the_reward_and_drops_the_loss(tok):
    from rlpost.rewards.scoring import Rewards

    # two prompts: episode 0 writes a malformed call (a void turn) then answers; episode 1 answers at once
    bad = _ids(tok, "<tool_call>{not json</tool_call>")
    ans = _ids(tok, "56088") + [tok.eos_token_id]
    eng = ScriptedEngine(tok, [bad, ans])
    scored = []

    def score(rows, texts, lengths):
        scored.append(list(texts))
        return Rewards(torch.ones(len(texts)), {"correct": torch.ones(len(texts))})

    for flt, expect_mask in [(False, len(bad) + len(ans)), (True, 0)]:
        eng.calls = []
        s = EpisodeSampler(1, max_turns=2, max_total_tokens=500, void_turn_filter=flt)
        res = s.sample(eng, [[3, 4]], SamplingParams(max_new_tokens=64), SamplerContext(score=score, step=1))
        assert int(res.generation.response_mask.sum()) == expect_mask
        if flt:  # scored once by the sampler, reward kept
            assert res.rewards.tolist() == [1.0] and res.metrics["episode/void_filtered_frac"] == 1.0
    assert scored == [["56088"]]


# ------------------------------------------------------------------ turn-level advantages and per-turn rewards
def test_turn_grpo_hand_computed_on_three_turn_episodes():
    from rlpost.algos.advantages import AdvantageInput, compute_advantages

    # row 0: turns at 0-1, 3, 5-6 (per-turn rewards 0.5, 0, 1.0 on each turn's last token); row 1: turns 0, 2-3
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1, 0], [1, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    tr = torch.zeros(2, 8)
    tr[0, 1], tr[0, 6], tr[1, 3] = 0.5, 1.0, 0.2
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=mask, group_index=torch.tensor([0, 0]),
                         token_rewards=tr)
    out = compute_advantages("turn_grpo", inp, gamma=0.5, norm_by_std=False)
    # outcome term +-0.5; return-to-go G: row 0 (0.75, 0.5, 1.0), row 1 (0.1, 0.2);
    # baselines per turn index: (0.425, 0.35, 1.0) -> turn terms row 0 (0.325, 0.15, 0), row 1 (-0.325, -0.15)
    assert torch.allclose(out.advantages[0], torch.tensor([0.825, 0.825, 0, 0.65, 0, 0.5, 0.5, 0]))
    assert torch.allclose(out.advantages[1], torch.tensor([-0.825, 0, -0.65, -0.65, 0, 0, 0, 0]))
    assert out.returns is None
    # turn_coef scales only the turn term; without token rewards it is GRPO exactly
    out2 = compute_advantages("turn_grpo", inp, gamma=0.5, norm_by_std=False, turn_coef=2.0)
    assert torch.allclose(out2.advantages[0, [0, 3, 5]], torch.tensor([1.15, 0.8, 0.5]))
    plain = AdvantageInput(rewards=inp.rewards, response_mask=mask, group_index=inp.group_index)
    assert torch.equal(compute_advantages("turn_grpo", plain).advantages, compute_advantages("grpo", plain).advantages)


def test_sao_value_targets_with_per_turn_token_rewards_and_no_critic_loss_on_env_tokens():
    from rlpost.algos.advantages import AdvantageInput, compute_advantages
    from rlpost.algos.aggregation import aggregate
    from rlpost.algos.regularizers import value_loss

    # 3 turns: tokens 0-1 | env 2-3 | token 4 | env 5 | tokens 6-7 | pad 8; turn rewards 0.5 and 0.25, outcome 1
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1, 0]], dtype=torch.float32)
    v = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4, 9.0, 0.6, 0.7, 9.0]])
    tr = torch.zeros(1, 9)
    tr[0, 1], tr[0, 4] = 0.5, 0.25
    inp = AdvantageInput(rewards=torch.tensor([1.0]), response_mask=mask, group_index=torch.tensor([0]), values=v,
                         token_rewards=tr)
    out = compute_advantages("sao", inp, gamma=1.0, lam=1.0, whiten=False)
    model = [0, 1, 4, 6, 7]
    assert torch.allclose(out.returns[0, model], torch.tensor([1.75, 1.75, 1.25, 1.0, 1.0]))
    assert torch.allclose(out.advantages[0, model], torch.tensor([1.65, 1.55, 0.85, 0.4, 0.3]))
    # gamma = 0.5: discount per model token; env tokens carry V and the return through
    out = compute_advantages("sao", inp, gamma=0.5, lam=1.0, whiten=False)
    # G7 = 1, G6 = .5, G4 = .25 + .25 = .5, G1 = .5 + .25 = .75, G0 = .375
    assert torch.allclose(out.returns[0, model], torch.tensor([0.375, 0.75, 0.5, 0.5, 1.0]))
    # the critic's loss (token-mean over the response mask) has no gradient on environment tokens or padding
    vals = v.clone().requires_grad_(True)
    loss_mat, _ = value_loss(vals, v, out.returns, mask, clip_range=None)
    aggregate("token-mean", loss_mat, mask).backward()
    assert vals.grad[0, [2, 3, 5, 8]].abs().sum() == 0
    assert torch.allclose(vals.grad[0, model], (v[0, model] - out.returns[0, model]) / 5)


class _EchoEnv:
    """Every turn gets an observation back (so every later turn follows environment text); turn k's reward is k / 10."""

    instructions = ""

    def __init__(self):
        self.k = 0

    def reset(self, example):
        return None

    def step(self, text):
        from rlpost.envs.base import EnvStep

        self.k += 1
        return EnvStep([{"role": "tool", "content": f"obs {self.k}"}], self.k / 10, False, {"tool_calls": 1})


@pytest.fixture
def echo_env(monkeypatch):
    import rlpost.samplers.episode as episode  # the sampler's own binding of make_env

    monkeypatch.setattr(episode, "make_env", lambda name, params=None: _EchoEnv())


def test_per_turn_rewards_sit_on_each_turns_last_model_token(tok, echo_env):
    t = [_ids(tok, "a b"), _ids(tok, "c"), _ids(tok, "d e f")]
    eng = ScriptedEngine(tok, t)
    s = EpisodeSampler(1, max_turns=3, max_total_tokens=1000, env_reward_weight=2.0, env_reward_at="turn")
    res = s.sample(eng, [[3, 4]], SamplingParams(max_new_tokens=16), SamplerContext(step=1))
    tr, m = res.extras["turn_rewards"][0], res.generation.response_mask[0]
    ins = [render_insert(tok, [{"role": "tool", "content": f"obs {k}"}], after_eos=False) for k in (1, 2)]
    ends = [len(t[0]) - 1, len(t[0]) + len(ins[0]) + len(t[1]) - 1, int(m.nonzero().max())]
    assert tr.nonzero().flatten().tolist() == ends and tr[ends].tolist() == pytest.approx([0.2, 0.4, 0.6])
    assert all(m[i] == 1 for i in ends) and "reward_env" not in res.extras and res.rewards is None


def test_turn_rewards_need_an_estimator_that_reads_token_rewards(compose, tmp_path):
    from rlpost.core.errors import ConfigError
    from rlpost.run.runner import Run

    with pytest.raises(ConfigError, match="env_reward_at=turn"):
        Run(compose(tiny_overrides("algo=grpo", "env=calculator", "sampler.params.env_reward_at=turn",
                                   "sampler.params.env_reward_weight=1.0")), tmp_path / "t")


# ------------------------------------------------------------------ ARPO / AEPO branching (real tiny model)
@pytest.fixture(scope="module")
def tiny_engine():
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine

    policy, tk = load_policy(compose_config(tiny_overrides()).model, torch.float32, seed=0)
    return HFRolloutEngine(policy, tk, batch_size=8)


def _check_tree(res, group, n_prompts):
    g, ex = res.generation, res.extras
    assert res.group_index.tolist() == sorted(res.group_index.tolist())  # rows grouped by prompt
    assert torch.bincount(res.group_index).tolist() == [group] * n_prompts  # the branch budget: exactly G rows
    for i, (par, n) in enumerate(zip(ex["branch_parent"].tolist(), ex["branch_prefix_len"].tolist())):
        if par < 0:
            assert n == 0
            continue
        assert res.group_index[par] == res.group_index[i] and n > 0
        for f in ("response_ids", "response_mask", "rollout_logprobs", "temperatures"):  # the prefix, id for id
            assert torch.equal(getattr(g, f)[i, :n], getattr(g, f)[par, :n]), f
        assert torch.equal(g.prompt_ids[i], g.prompt_ids[par])


def test_arpo_branches_share_the_prefix_exactly_and_respect_the_budget(tiny_engine, echo_env):
    prompts = [[5, 6, 7], [8, 9]]
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, stop=list("aeiou "))  # random model: end turns early
    s = EpisodeSampler(4, max_turns=3, max_total_tokens=400, branching="arpo", initial_rollouts=1, branch_width=2,
                       branch_probability=1.0, entropy_weight=0.0)  # always branch: 1 global + 3 branches per prompt
    res = s.sample(tiny_engine, prompts, sp, SamplerContext(step=1))
    _check_tree(res, 4, 2)
    par = res.extras["branch_parent"]
    assert int((par >= 0).sum()) == 6 and res.metrics["episode/branches"] == 6
    # the first branches re-sample turn 2: they share turn 1 and the inserted observation, nothing more
    first = res.extras["branch_prefix_len"][par == 0]
    m0 = res.generation.response_mask[0]
    turn1 = int(m0.tolist().index(0.0))
    ins = len(render_insert(tiny_engine.tokenizer, [{"role": "tool", "content": "obs 1"}],
                            after_eos=int(res.generation.response_ids[0, turn1 - 1]) in tiny_engine.eos_ids))
    assert first.tolist()[0] == turn1 + ins
    # never branching: the budget is filled with global episodes
    s0 = EpisodeSampler(4, max_turns=3, max_total_tokens=400, branching="arpo", branch_probability=0.0, entropy_weight=0.0)
    res0 = s0.sample(tiny_engine, prompts, sp, SamplerContext(step=1))
    _check_tree(res0, 4, 2)
    assert res0.extras["branch_parent"].tolist() == [-1] * 8 and res0.metrics["episode/branches"] == 0


def test_aepo_penalises_consecutive_branching_and_sets_the_global_count_from_entropy(tiny_engine, echo_env):
    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=4, stop=list("aeiou "))
    s = EpisodeSampler(4, max_turns=4, max_total_tokens=400, branching="aepo", branch_width=1,
                       branch_probability=1.0, entropy_weight=0.0, aepo_penalty=1.0)
    assert s.n_global(4) == 2  # first step: sigmoid(0) = 1/2
    res = s.sample(tiny_engine, [[5, 6, 7]], sp, SamplerContext(step=1))
    _check_tree(res, 4, 1)
    # penalty 1: after one branching step a path never branches again, so each global episode branches once
    par = res.extras["branch_parent"].tolist()
    assert sorted(p for p in par if p >= 0) == [0, 1]
    assert s._h_root is not None and s._h_tool is not None  # pre-monitoring for the next step
    s._h_root, s._h_tool = 1.0, 1.0
    assert s.n_global(4) == 2
    s._h_root = 3.0  # sigmoid(2) * 4 = 3.52
    assert s.n_global(4) == 4 and s.n_global(8) == 7
    s._h_root = -9.0
    assert s.n_global(4) == 1


def test_trainer_log_probs_see_the_environment_text_the_rollout_saw(tiny_engine, echo_env):
    """The trainer recomputes each model token's log-prob with the inserted environment tokens attended to
    (``extras['response_attn']``), so on-policy it matches the engine's rollout log-probs; attending only to
    the loss mask (the trainer's default) would condition turns 2+ on a context without the tool results."""
    from rlpost.models.logprobs import response_logprobs

    sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, stop=list("aeiou "))
    res = EpisodeSampler(2, max_turns=3, max_total_tokens=400).sample(tiny_engine, [[5, 6, 7]], sp, SamplerContext(step=1))
    g = res.generation
    m, attn = g.response_mask, res.extras["response_attn"]
    assert int(attn.sum()) > int(m.sum()) and bool((attn >= m).all())  # env tokens attended, not trained
    with torch.no_grad():
        lp, _ = response_logprobs(tiny_engine.model, g.prompt_ids, g.prompt_mask, g.response_ids, attn, g.temperatures)
        wrong, _ = response_logprobs(tiny_engine.model, g.prompt_ids, g.prompt_mask, g.response_ids, (m > 0).long(),
                                     g.temperatures)
    gap = ((lp - g.rollout_logprobs).abs() * m).sum() / m.sum()
    assert gap < 1e-4
    assert ((wrong - g.rollout_logprobs).abs() * m).sum() / m.sum() > 1e-2


def test_gpu_check_agent_part_dry_run_on_cpu(tmp_path):
    """scripts/gpu_check.py --dry-run --part agent: the multi-turn vLLM check's own code path, with the hf engine."""
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path / "gc.json"
    p = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--part", "agent", "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = json.loads(out.read_text())
    assert [r["check"] for r in recs] == ["agent_episode"] and recs[0]["pass"]
    assert recs[0]["turns_per_episode"] >= 2 and recs[0]["gap"] <= 1e-3


# ------------------------------------------------------------------ partial rollouts of unfinished episodes
class _Recording(RolloutEngine):
    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.tokenizer, self.pad_id, self.eos_ids = inner.tokenizer, inner.pad_id, inner.eos_ids

    def generate(self, prompts, params):
        g = self.inner.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], g))
        return g

    def sync_weights(self, policy):
        self.inner.sync_weights(policy)


def test_carried_episodes_resume_token_exact_under_new_weights(compose, echo_env):
    """APRIL-style carry of whole episodes: an episode begun under version v resumes at its next turn
    under version v+1; its row is exactly the sampled turns plus inserted text, each turn's log-probs are
    those recorded when it was sampled, and token_version says which weights sampled which turn."""
    from rlpost.algos.turns import turn_spans
    from rlpost.models.loader import load_policy
    from rlpost.rollout.hf import HFRolloutEngine
    from rlpost.samplers.episode_partial import EpisodePartialProducer

    policy, tk = load_policy(compose(tiny_overrides()).model, torch.float32, seed=0)
    eng = _Recording(HFRolloutEngine(policy, tk, batch_size=8))
    s = EpisodeSampler(2, max_turns=3, max_total_tokens=400)
    prod = EpisodePartialProducer(s, 2, over_provision=2.0, pad_id=tk.pad_token_id)
    queue = iter(range(100))
    prompts = {i: [5 + i, 6, 7] for i in range(100)}
    rows, multi = [], 0
    for step in range(4):
        sp = SamplingParams(max_new_tokens=24, temperature=1.0, seed=10 + step, stop=list("aeiou "))
        ps = prod.produce(1, lambda: [next(queue)], prompts.__getitem__, eng, sp, version=step, weights_step=step)
        assert len(ps.texts) == 2 and ps.batch.group.unique().numel() == 1  # one whole group per step
        rows.append(ps)
        with torch.no_grad():  # new weights for the next step
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
    resumed = 0
    for ps in rows:
        b, attn = ps.batch, ps.extras["response_attn"]
        for i in range(len(ps.texts)):
            p = b.prompt_ids[i][b.prompt_mask[i] > 0].tolist()
            full = p + b.response_ids[i][: int(attn[i].sum())].tolist()
            m = b.response_mask[i]
            assert int(attn[i].sum()) >= int(m.sum())
            for s0, e0 in turn_spans(m):  # each turn: sent as prompt + everything before it, sampled exactly these ids
                hit = [(sent[j], g) for sent, g in eng.calls for j in range(len(sent))
                       if sent[j] == full[: len(p) + s0]
                       and g.response_ids[j][g.response_mask[j] > 0].tolist()[: e0 - s0] == full[len(p) + s0: len(p) + e0]
                       and torch.allclose(g.rollout_logprobs[j][: e0 - s0], b.rollout_logprobs[i, s0:e0])]
                assert hit, (i, s0, e0)
            versions = set(b.token_version[i][m > 0].tolist())
            resumed += len(versions) > 1
    assert resumed >= 1  # at least one released episode was carried across a weight change mid-episode
    assert any(r.metrics["partial/resumed_frac"] > 0 for r in rows)
    assert all("episode/turns_mean" in r.metrics for r in rows)


def test_async_partial_rollouts_train_on_episodes(compose, tmp_path):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=grpo", "env=calculator", "task=multiply", "executor=async",
                                 "executor.partial_rollout=true", "executor.over_provision=2.0", "steps=2",
                                 "eval.at_end=false", "eval.every=0", "sampler.params.max_total_tokens=24",
                                 "checkpoint.every=0", "selector.prompts_per_step=2", "algo.n_samples_per_prompt=2"))
    train(cfg, tmp_path / "a")
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode/turns_mean" in r]
    assert len(steps) == 2 and all("partial/carried_groups" in r for r in steps)
    assert steps[1]["partial/carried_in_groups"] >= 1  # over-provisioned groups were carried into step 2
    assert (tmp_path / "a" / "transcripts" / "step_000002.json").exists()


def test_void_turn_filter_drops_a_final_turn_without_an_answer(tok, compose):
    """SimpleTIR: a turn with neither a tool call nor an answer is void; with the filter that episode gets no loss."""
    from rlpost.rewards.scoring import Rewards
    from rlpost.tasks.base import build_task

    task = build_task(compose(tiny_overrides()).task)
    assert task.extract_answer("no idea") is None and task.extract_answer("56088") is not None

    def score(rows, texts, lengths):
        return Rewards(torch.zeros(len(texts)), {"correct": torch.zeros(len(texts))})

    masks = []
    for text in ("no idea", "56088"):
        eng = ScriptedEngine(tok, [_ids(tok, text) + [tok.eos_token_id]])
        s = EpisodeSampler(1, max_turns=2, max_total_tokens=500, void_turn_filter=True)
        s.attach(task=task)
        res = s.sample(eng, [[3, 4]], SamplingParams(max_new_tokens=64), SamplerContext(score=score, step=1))
        masks.append(int(res.generation.response_mask.sum()))
        assert res.metrics["episode/void_filtered_frac"] == (1.0 if text == "no idea" else 0.0)
    assert masks[0] == 0 and masks[1] > 0
