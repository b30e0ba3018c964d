"""MIPU: the inference-gap proxy by hand, its settings, and the update gate (a rejected candidate restores
weights and optimizer exactly, an accepted one equals the plain update). Moved unchanged from
tests/test_rollout_mtp_vllm_spec_mipu.py.
"""

import json

import pytest
import torch

from rlpost.core.errors import ConfigError

from conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- MIPU
def test_mipu_gap_proxy_hand_computed():
    import math

    from rlpost.algos.mipu import inference_gap_proxy

    old = torch.tensor([[-1.0, -2.0, -0.5]])
    new = old + torch.tensor([[math.log(2.0), math.log(0.5), 3.0]])
    adv = torch.tensor([[1.0, -1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding: ignored
    out = inference_gap_proxy(new, old, adv, mask)
    # r = 2 and 0.5: gain = mean((2-1)*1, (0.5-1)*(-1)) = 0.75; k3 = mean(2-1-ln2, 0.5-1+ln2) = 0.25
    assert out["gain"] == pytest.approx(0.75)
    assert out["kl"] == pytest.approx(0.25)
    assert out["ratio_mean"] == pytest.approx(1.25)
    with pytest.raises(ValueError, match="no token"):
        inference_gap_proxy(new, old, adv, torch.zeros(1, 3))


def test_mipu_settings_errors(compose):
    from rlpost.algos.mipu import check_update_gate, gate_settings

    assert gate_settings(None) is None
    assert gate_settings({"name": "mipu"}) == {"name": "mipu", "min_gain": 0.0, "max_kl": None}
    with pytest.raises(ConfigError, match="unknown key"):
        gate_settings({"name": "mipu", "min_gian": 0.1})
    with pytest.raises(ConfigError, match="max_kl"):
        gate_settings({"name": "mipu", "max_kl": 0})
    cfg = compose(tiny_overrides("algo=mipu", "precision=rollout_fp8_sim"))
    assert check_update_gate(cfg)["min_gain"] == 0.0
    with pytest.raises(ConfigError, match="trainer=torch"):
        check_update_gate(compose(tiny_overrides("algo=mipu", "trainer=deepspeed")))
    with pytest.raises(ConfigError, match="rollout=hf"):
        check_update_gate(compose(tiny_overrides("algo=mipu", "rollout=vllm", "precision=bf16")))


def _mipu_setup(compose, min_gain):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_worker import make_batch

    from rlpost.methods.mipu import UpdateGate
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy
    from rlpost.rollout import EngineConfig, build_engine
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("algo=mipu", "precision=rollout_fp8_sim", "trainer.lr=1e-2",
                                 f"algo.update_gate.min_gain={min_gain}"))
    model, tok = load_policy(ModelConfig(source="tiny"), seed=3)
    trainer = TorchTrainer.from_config(model, cfg, "cpu")
    eng = build_engine(EngineConfig.of(cfg), trainer.policy, tok, torch.device("cpu"))
    gate = UpdateGate(cfg)
    gate.validate()
    return cfg, trainer, eng, gate.gate, make_batch()


def _gate_update(gate, trainer, eng, batch, rng):
    return gate.update(lambda: trainer.policy_update(batch, rng), eng, batch, trainer.policy, trainer.snapshot,
                       trainer.restore)


def _opt_tensors(opt):
    return [(k, v.clone()) for s in opt.state_dict()["state"].values() for k, v in sorted(s.items())
            if torch.is_tensor(v)]


def test_mipu_rejected_candidate_restores_weights_and_optimizer_exactly(compose):
    from rlpost.algos.mipu import inference_logprobs

    _, trainer, eng, gate, batch = _mipu_setup(compose, 1e9)  # no candidate can reach this gain: always rejected
    # one accepted plain step first, so the optimizer already has moments to restore
    trainer.policy_update(batch, torch.Generator().manual_seed(0))
    eng.sync_weights(trainer.policy)
    w0 = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    o0 = _opt_tensors(trainer.opt)
    s0 = trainer.sched.state_dict()["last_epoch"]
    lp_inf0 = inference_logprobs(eng, batch)
    m = _gate_update(gate, trainer, eng, batch, torch.Generator().manual_seed(1))
    assert m["mipu/accepted"] == 0.0 and m["mipu/accept_rate"] == 0.0
    assert m["loss/policy"] != 0.0 and m["mipu/kl"] > 0  # a real candidate was built and scored, then undone
    for k, v in trainer.policy.state_dict().items():
        assert torch.equal(v, w0[k]), k
    o1 = _opt_tensors(trainer.opt)
    assert len(o1) == len(o0) > 0 and all(torch.equal(a[1], b[1]) for a, b in zip(o0, o1))
    assert trainer.sched.state_dict()["last_epoch"] == s0
    assert torch.equal(inference_logprobs(eng, batch), lp_inf0)  # the inference copy is back too


def test_mipu_accepted_candidate_equals_the_plain_update(compose):
    _, t_gate, eng, gate, batch = _mipu_setup(compose, -1e9)  # every candidate accepted
    _, t_plain, _, _, _ = _mipu_setup(compose, -1e9)
    m = _gate_update(gate, t_gate, eng, batch, torch.Generator().manual_seed(1))
    t_plain.policy_update(batch, torch.Generator().manual_seed(1))
    assert m["mipu/accepted"] == 1.0 and m["mipu/accept_rate"] == 1.0
    for (k, a), b in zip(t_gate.policy.state_dict().items(), t_plain.policy.state_dict().values()):
        assert torch.equal(a, b), k
    # the engine's inference copy was synced to the accepted weights (fp8-rounded copy of them)
    from rlpost.algos.mipu import inference_logprobs

    lp = inference_logprobs(eng, batch)
    assert float(((lp - batch.rollout_logprobs).abs() * batch.response_mask).sum()) > 0


def test_mipu_runs_two_steps_through_the_runner(tmp_path):
    import json

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import train

    cfg = compose_config(["model=tiny", "logger=jsonl", "rollout.max_new_tokens=6", "selector.prompts_per_step=2",
                          "algo.n_samples_per_prompt=4", "eval.at_end=false", "checkpoint.every=0", "algo=mipu",
                          "precision=rollout_fp8_sim", "steps=2"])
    train(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    acc = [r["mipu/accepted"] for r in rows if "mipu/accepted" in r]
    assert len(acc) == 2 and all(a in (0.0, 1.0) for a in acc)
    assert all(r["mipu/accept_rate"] == pytest.approx(sum(acc[: i + 1]) / (i + 1))
               for i, r in enumerate(x for x in rows if "mipu/accepted" in x))
