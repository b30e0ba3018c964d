"""GRPO-VPS (arXiv:2604.20659): answer-probability probes at step boundaries refine GRPO's advantage.

Hand-computed cases of the estimator and of the probes (a character tokenizer and a fake
log-prob pass whose answer probability is known), the bad inputs (no steps, no reference
answer, a misspelt or bad parameter) and the plumbing on ``model=tiny``.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from rlpost.algos.advantages import AdvantageInput, compute_advantages
from rlpost.core.errors import ConfigError
from conftest import CharTok  # noqa: E402


def batch_of(prompts, responses, answers, R=8):
    from rlpost.core.batch import RolloutBatch

    B = len(prompts)
    P = max(len(p) for p in prompts)
    pid, pm = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    rid, rm = torch.zeros(B, R, dtype=torch.long), torch.zeros(B, R)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        pid[i, P - len(p):] = torch.tensor([ord(c) for c in p])
        pm[i, P - len(p):] = 1
        if r:
            rid[i, :len(r)] = torch.tensor([ord(c) for c in r])
            rm[i, :len(r)] = 1
    return RolloutBatch(prompt_ids=pid, prompt_mask=pm, response_ids=rid, response_mask=rm,
                        rollout_logprobs=torch.zeros(B, R), group_index=torch.zeros(B, dtype=torch.long),
                        prompt_index=torch.zeros(B, dtype=torch.long), response_texts=list(responses),
                        answers=list(answers))


def fake_logprobs(seen):
    """p(answer | probe) = 0.1 x (number of real probe-prompt tokens), put on the first answer token."""

    def lp(pb):
        seen.append(pb)
        out = torch.zeros(pb.response_ids.shape)
        out[:, 0] = torch.log(0.1 * pb.prompt_mask.sum(-1).double()).float()
        return out, None

    return lp


def test_vps_advantage_by_hand():
    # One group, rewards (1, 0): GRPO A = +-0.5 / std(1, 0) = +-0.5 / 0.70711 = +-0.70711.
    # Row 0 tokens in steps (1, 1, 2) with progress d = (0.3, 0.3, 0.1); row 1 in steps (1, 2, -) with
    # d = (-0.2, 0.0, -). The group's steps: 0.3, 0.1, -0.2, 0.0 (each once): mean 0.05, deviations
    # .25, .05, -.25, -.05, sum of squares .13, / 3 = .043333, std .208167 ->
    # z = 1.20096, 0.24019, -1.20096, -0.24019.
    # Row 0: 0.70711 + (1.20096, 1.20096, 0.24019) = (1.90807, 1.90807, 0.94730);
    # row 1: -0.70711 + (-1.20096, -0.24019, 0) = (-1.90807, -0.94730, -0.70711) (token 3 is in no step).
    prog = torch.tensor([[0.3, 0.3, 0.1], [-0.2, 0.0, 0.0]])
    seg = torch.tensor([[1, 1, 2], [1, 2, 0]])
    inp = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 3),
                         group_index=torch.zeros(2, dtype=torch.long),
                         extras={"vps_progress": prog, "vps_segment": seg})
    A = compute_advantages("grpo_vps", inp).advantages
    assert torch.allclose(A, torch.tensor([[1.90807, 1.90807, 0.94730], [-1.90807, -0.94730, -0.70711]]), atol=1e-4)
    # invariants: weight 0 is GRPO; progress shifts but the outcome's sign dominates a flat-progress group
    g = compute_advantages("grpo_vps", inp, progress_weight=0.0).advantages
    assert torch.allclose(g, compute_advantages("grpo", inp).advantages, atol=1e-6)
    flat = AdvantageInput(rewards=torch.tensor([1.0, 0.0]), response_mask=torch.ones(2, 3),
                          group_index=torch.zeros(2, dtype=torch.long),
                          extras={"vps_progress": torch.full((2, 3), 0.2), "vps_segment": seg})
    assert torch.allclose(compute_advantages("grpo_vps", flat).advantages, g, atol=1e-6)  # equal progress: GRPO
    same = AdvantageInput(rewards=torch.tensor([1.0, 1.0]), response_mask=torch.ones(2, 3),
                          group_index=torch.zeros(2, dtype=torch.long), extras=inp.extras)
    assert torch.equal(compute_advantages("grpo_vps", same).advantages, torch.zeros(2, 3))  # zero variance: 0
    half = compute_advantages("grpo_vps", inp, progress_weight=0.5).advantages
    assert torch.allclose(half - g, 0.5 * (A - g), atol=1e-5)  # the refinement is linear in the weight


def test_vps_estimator_refuses_missing_probes_and_negative_weight():
    inp = AdvantageInput(rewards=torch.ones(2), response_mask=torch.ones(2, 1), group_index=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="vps_progress"):
        compute_advantages("grpo_vps", inp)
    inp.extras = {"vps_progress": torch.zeros(2, 1), "vps_segment": torch.zeros(2, 1, dtype=torch.long)}
    with pytest.raises(ValueError, match="progress_weight"):
        compute_advantages("grpo_vps", inp, progress_weight=-1.0)


def test_answer_probes_by_hand():
    from rlpost.algos.vps import answer_progress

    # prompt "Q"; row 0 answers "ab\ncd" (steps "ab" ending at token 1, "cd" ending at token 4); the
    # probes are "Q=" (2 tokens), "Qab=" (4), "Qab\ncd=" (7) -> p = 0.2, 0.4, 0.7, progress (0.2, 0.3):
    # tokens 0-1 carry 0.2 (step 1), tokens 2-4 carry 0.3 (step 2: the newline opens it).
    # Row 1 is empty: no step, no probe, GRPO's advantage.
    seen = []
    b = batch_of(["Q", "Q"], ["ab\ncd", ""], ["7", "7"])
    prog, seg, m = answer_progress(b, fake_logprobs(seen), CharTok(), "newline", "=")
    assert torch.allclose(prog[0, :5], torch.tensor([0.2, 0.2, 0.3, 0.3, 0.3]), atol=1e-6)
    assert seg[0, :6].tolist() == [1, 1, 2, 2, 2, 0] and prog[0, 5:].abs().sum() == 0
    assert prog[1].abs().sum() == 0 and seg[1].sum() == 0
    pb = seen[0]
    assert len(pb) == 3  # K + 1 probes of row 0, none of row 1
    texts = ["".join(chr(t) for t in pb.prompt_ids[j][pb.prompt_mask[j] > 0].tolist()) for j in range(3)]
    assert texts == ["Q=", "Qab=", "Qab\ncd="]
    assert pb.response_ids[:, 0].tolist() == [ord("7")] * 3 and pb.response_mask.sum() == 3  # only the answer is scored
    assert m["adv/vps_no_step_rows"] == 1.0 and m["adv/vps_steps_per_row"] == 2.0
    assert m["adv/vps_p_final_mean"] == pytest.approx(0.7) and m["adv/vps_progress_mean"] == pytest.approx(0.25)


def test_answer_probes_need_a_reference_answer():
    from rlpost.algos.vps import answer_progress

    b = batch_of(["Q"], ["ab"], [None])
    with pytest.raises(ValueError, match="reference answer"):
        answer_progress(b, fake_logprobs([]), CharTok(), "newline", "=")


def test_method_stops_when_no_response_has_a_step_and_checks_its_parameters(compose):
    from conftest import tiny_overrides
    from rlpost.methods.base import MethodSet

    cfg = compose(tiny_overrides("algo=grpo_vps", "algo.adv_params.segment=step_k"))
    ms = MethodSet.for_config(cfg)
    assert ms.names == ["grpo_vps"] and set(ms.needs().provides) == {"vps_progress", "vps_segment"}
    b = batch_of(["Q", "Q"], ["no marker here", "nor here"], ["7", "7"], R=24)
    run = SimpleNamespace(logprobs=fake_logprobs([]), tokenizer=CharTok(), step=1)
    with pytest.raises(ConfigError, match="found no steps.*segment=newline"):
        ms.prepare(b, run)
    ok = batch_of(["Q", "Q"], ["Step 1: ab\nStep 2: cd", "nor here"], ["7", "7"], R=24)
    metrics = ms.prepare(ok, run)  # one row with steps is enough; the other keeps GRPO's advantage
    assert metrics["adv/vps_no_step_rows"] == 1.0 and ok.extras["vps_segment"][0].max() == 2
    with pytest.raises(ConfigError, match="segment"):
        MethodSet.for_config(compose(tiny_overrides("algo=grpo_vps", "algo.adv_params.segment=paragraph")))
    with pytest.raises(ConfigError, match="progress_weight"):
        MethodSet.for_config(compose(tiny_overrides("algo=grpo_vps", "algo.adv_params.progress_weight=-1")))
    with pytest.raises(ConfigError, match="progres_weight"):
        MethodSet.for_config(compose(tiny_overrides("algo=grpo_vps", "+algo.adv_params.progres_weight=1")))


def test_grpo_vps_trains_on_tiny(tmp_path):
    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=6", "selector.prompts_per_step=2",
                          "algo=grpo_vps", "algo.n_samples_per_prompt=4", "eval.at_end=false", "checkpoint.every=0",
                          "steps=1"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r = [r for r in rows if "reward/mean" in r][0]
    assert r["adv/vps_steps_per_row"] >= 1 and 0 < r["adv/vps_p_final_mean"] < 1
    assert math.isfinite(r["loss/policy"] if "loss/policy" in r else 0.0)
