"""rollout=hf_mtp: Bebop's MTP draft head as a rollout.speculative drafter (settings, pre-RL fit, head files).

The exactness of the MTP verify loop is tested in tests/test_method_bebop.py; here: the config
errors, the fit and its save/load round trip, and a 2-step training run through the runner.
"""

import json

import pytest
import torch
from omegaconf import OmegaConf

from rlpost.core.errors import ConfigError
from rlpost.rollout.base import SamplingParams
from rlpost.rollout.hf import HFRolloutEngine
from rlpost.rollout.self_spec import MTP_KEYS, check_speculative, spec_config
from spec_helpers import _tiny_llama, _Tok
from conftest import tiny_overrides


pytestmark = pytest.mark.usefixtures("one_thread")


def _mtp_cfg(**spec):
    """A minimal config for :func:`rlpost.rollout.mtp_draft.mtp_engine` on the 5-token test model."""
    return OmegaConf.create({
        "seed": 3, "model": {"name": "tiny5", "routing_replay": "off"},
        "rollout": {"engine": "hf", "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "stop": [],
                    "speculative": {"drafter": "mtp_head", "switch_batch": 64, "draft_len": 2,
                                    "mtp_head_steps": 20, "mtp_head_lr": 1e-2, "mtp_head_prompts": 6, **spec}},
    })


def _prompts(n):
    return [[1, 2, 3], [2, 3], [4, 1, 2, 2], [3], [1, 1, 4], [2, 4, 3]][:n]


def test_spec_config_mtp_keys_and_errors(compose):
    c = spec_config({"drafter": "mtp_head"})
    assert (c["mtp_head_loss"], c["mtp_head_path"], c["mtp_head_depth"]) == ("tv", None, 2)
    assert set(MTP_KEYS) == {"mtp_head_path", "mtp_head_loss", "mtp_head_depth", "mtp_head_steps", "mtp_head_lr",
                             "mtp_head_prompts"}
    assert spec_config({"drafter": "mtp_head", "mtp_head_path": "null"})["mtp_head_path"] is None
    assert spec_config({"drafter": "mtp_head", "mtp_head_loss": "ce"})["mtp_head_loss"] == "ce"
    with pytest.raises(ConfigError, match="unknown key.*mtp_head_los"):
        spec_config({"drafter": "mtp_head", "mtp_head_los": "tv"})
    with pytest.raises(ConfigError, match=r"only apply to drafter=mtp_head.*Fix: drop them"):
        spec_config({"drafter": "int8", "mtp_head_steps": 3})
    with pytest.raises(ConfigError, match="mtp_head_loss='kl' is not a head loss; valid: tv"):
        spec_config({"drafter": "mtp_head", "mtp_head_loss": "kl"})
    with pytest.raises(ConfigError, match="mtp_head_depth must be >= 1"):
        spec_config({"drafter": "mtp_head", "mtp_head_depth": 0})
    with pytest.raises(ConfigError, match="mtp_head_lr must be > 0"):
        spec_config({"drafter": "mtp_head", "mtp_head_lr": 0})
    with pytest.raises(ConfigError, match="neither a simulated rollout precision nor mtp_head"):
        spec_config({"drafter": "mtp"})
    # the preset composes to drafter=mtp_head; switching its drafter keeps the head keys: an error, not ignored
    cfg = compose(tiny_overrides("rollout=hf_mtp"))
    assert check_speculative(cfg)["drafter"] == "mtp_head"
    with pytest.raises(ConfigError, match="only apply to drafter=mtp_head"):
        check_speculative(compose(tiny_overrides("rollout=hf_mtp", "rollout.speculative.drafter=int8")))
    ray = OmegaConf.create({"rollout": {"engine": "hf", "speculative": {"drafter": "mtp_head"}},
                            "model": {"routing_replay": "off"}, "launcher": {"name": "ray"}})
    with pytest.raises(ConfigError, match="launcher=ray.*mtp_head_path"):
        check_speculative(ray)
    ray.rollout.speculative.mtp_head_path = "/some/head.pt"
    assert check_speculative(ray)["mtp_head_path"] == "/some/head.pt"


def test_fit_leaves_the_policy_untouched_and_raises_acceptance():
    from rlpost.rollout.mtp_draft import fit_mtp_head

    model = _tiny_llama(4)  # parameters require grad, as the trainer's policy does
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng = HFRolloutEngine(model, _Tok(), batch_size=64)
    rng = torch.get_rng_state()
    head, info = fit_mtp_head(model, eng, _prompts(6), SamplingParams(max_new_tokens=8, seed=3), depth=2, steps=60,
                              lr=1e-2, seed=3)
    assert torch.equal(rng, torch.get_rng_state())  # the head's initialisation drew from a forked RNG
    assert all(q.requires_grad and q.grad is None for q in model.parameters())  # flags restored, no gradient
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert info["responses"] >= 1 and info["positions"] >= info["responses"]
    assert info["loss_last"] < info["loss_first"]
    assert info["expected_accepted"] > info["expected_accepted_untrained"]
    assert info["loss_last"] == pytest.approx(1 - info["expected_accepted"] / 2, abs=0.02)
    # the same seed fits the same head
    head2, _ = fit_mtp_head(model, eng, _prompts(6), SamplingParams(max_new_tokens=8, seed=3), depth=2, steps=60,
                            lr=1e-2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), head2.state_dict().values()))
    with pytest.raises(ValueError, match="long enough"):
        fit_mtp_head(model, eng, [[1]], SamplingParams(max_new_tokens=1, seed=3), depth=3, steps=1)


def test_head_file_round_trip_gives_identical_drafts(tmp_path):
    from rlpost.rollout.mtp_draft import HEAD_FILE, acceptance_of_head, load_mtp_head, mtp_engine, mtp_training_pairs
    from rlpost.rollout.self_spec import spec_config as sc

    model = _tiny_llama(5).requires_grad_(False)
    cfg = _mtp_cfg()
    c = sc(cfg.rollout.speculative)
    eng = mtp_engine(cfg, HFRolloutEngine(model, _Tok(), batch_size=64), c, run_dir=tmp_path, prompts=_prompts)
    path = tmp_path / HEAD_FILE
    assert path.is_file()
    info = eng.pop_metrics()
    assert info["mtp_head/steps"] == 20 and info["mtp_head/expected_accepted"] > 0
    assert "mtp_head/steps" not in eng.pop_metrics()  # reported once
    # a second build in the same run directory (a resume) reuses the file: no prompts needed
    eng2 = mtp_engine(cfg, HFRolloutEngine(model, _Tok(), batch_size=64), c, run_dir=tmp_path, prompts=None)
    sd1, sd2 = eng.head.state_dict(), eng2.head.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert eng2.pop_metrics()["mtp_head/expected_accepted"] == pytest.approx(info["mtp_head/expected_accepted"])
    params = SamplingParams(max_new_tokens=8, seed=11)
    g1, g2 = eng.generate(_prompts(6), params), eng2.generate(_prompts(6), params)
    m1, m2 = eng.pop_metrics(), eng2.pop_metrics()
    assert torch.equal(g1.response_ids, g2.response_ids) and torch.equal(g1.rollout_logprobs, g2.rollout_logprobs)
    assert m1["spec/draft_tokens"] > 0 and m1 == m2
    ids = torch.randint(1, 5, (4, 9), generator=torch.Generator().manual_seed(0))
    pairs = mtp_training_pairs(model, ids, depth=2)
    head, meta = load_mtp_head(path, model)
    assert meta["loss"] == "tv" and meta["depth"] == 2
    assert acceptance_of_head(head, *pairs) == acceptance_of_head(eng.head, *pairs)
    # an explicit mtp_head_path wins over fitting
    other = tmp_path / "elsewhere"
    cfg3 = _mtp_cfg(mtp_head_path=str(path))
    eng3 = mtp_engine(cfg3, HFRolloutEngine(model, _Tok(), batch_size=64), sc(cfg3.rollout.speculative),
                      run_dir=other, prompts=None)
    assert torch.equal(eng3.head.proj.weight, eng.head.proj.weight) and not other.exists()
    with pytest.raises(ConfigError, match="no head and nothing to fit one on"):
        mtp_engine(cfg, HFRolloutEngine(model, _Tok(), batch_size=64), c, run_dir=other, prompts=None)


def test_head_file_for_another_model_is_a_config_error(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlpost.rollout.mtp_draft import MTPDraftHead, load_mtp_head, mtp_engine, save_mtp_head

    model = _tiny_llama(6).requires_grad_(False)  # width 16, vocabulary 5
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=5, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    path = save_mtp_head(tmp_path / "wide.pt", MTPDraftHead(wide))
    with pytest.raises(ConfigError, match="width 32 and vocabulary 5; this policy has width 16"):
        load_mtp_head(path, model)
    cfg = _mtp_cfg(mtp_head_path=str(path))  # the same error through the engine build
    with pytest.raises(ConfigError, match=r"mtp_head_path=.*wide.pt.*Fix: point"):
        mtp_engine(cfg, HFRolloutEngine(model, _Tok()), spec_config(cfg.rollout.speculative), prompts=_prompts)
    # a head of the right width but another MLP size in a bare state_dict is loaded at its own size
    h8 = MTPDraftHead(model, hidden=8)
    torch.save(h8.state_dict(), tmp_path / "bare.pt")
    assert load_mtp_head(tmp_path / "bare.pt", model)[0].up.out_features == 8
    sd = h8.state_dict()
    sd["down.weight"] = torch.zeros(16, 7)  # inconsistent shapes inside the file
    torch.save(sd, tmp_path / "broken.pt")
    with pytest.raises(ConfigError, match="does not fit this policy's head shapes"):
        load_mtp_head(tmp_path / "broken.pt", model)
    (tmp_path / "junk.pt").write_text("not a head")
    with pytest.raises(ConfigError, match="is not a saved MTP head"):
        load_mtp_head(tmp_path / "junk.pt", model)
    with pytest.raises(ConfigError, match="no such file"):
        load_mtp_head(tmp_path / "missing.pt", model)


def test_task_prompts_seeded_and_capped():
    from rlpost.tasks.base import task_prompts

    class Task:
        def render_prompt(self, ex, tok):
            return [ex, ex + 1]

    fn = task_prompts(Task(), None, seed=0, examples=list(range(10)))
    a = fn(4)
    assert a == fn(4) and len(a) == 4 and len({p[0] for p in a}) == 4
    assert sorted(p[0] for p in fn(99)) == list(range(10))  # capped at the split's size
    assert task_prompts(Task(), None, seed=1, examples=list(range(10)))(10) != fn(10)


def test_hf_mtp_two_training_steps(tmp_path):
    """`rlpost train model=tiny rollout=hf_mtp steps=2`: the head is fitted, saved and drafts every step's rows."""
    from rlpost.config.compose import compose_config
    from rlpost.rollout.mtp_draft import HEAD_FILE, load_mtp_head
    from rlpost.run.runner import train

    over = tiny_overrides("rollout=hf_mtp", "steps=2", "selector.prompts_per_step=2", "eval.at_end=false",
                          "checkpoint.every=0", "rollout.max_new_tokens=6", "rollout.speculative.switch_batch=64",
                          "rollout.speculative.mtp_head_steps=4", "rollout.speculative.mtp_head_prompts=3")
    train(compose_config(over), tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "spec/accept_rate" in r]
    assert len(steps) == 2
    for r in steps:  # every row is speculated (switch_batch 64 >= 8 rows)
        assert r["spec/spec_rows"] == 8 and r["spec/ar_tokens"] == 0 and r["spec/draft_tokens"] > 0
        assert 0.0 <= r["spec/accept_rate"] <= 1.0
        assert r["spec/accept_rate"] == pytest.approx(r["spec/accepted_tokens"] / r["spec/draft_tokens"])
    assert steps[0]["mtp_head/steps"] == 4 and "mtp_head/steps" not in steps[1]
    assert 0.0 < steps[0]["mtp_head/expected_accepted"] <= 2.0
    head, meta = load_mtp_head(tmp_path / HEAD_FILE, _tiny_policy())
    assert meta["loss"] == "tv" and meta["steps"] == 4 and meta["responses"] <= 3


def _tiny_policy():
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy

    return load_policy(compose_config(["model=tiny"]).model, seed=0)[0]


def test_head_follows_a_rebuilt_rollout_copy_and_keeps_its_weights():
    """A quantised rollout copy is rebuilt at every sync: the head then reads the new copy, its own weights unchanged."""
    from rlpost.rollout.mtp_draft import MTPDraftHead, MTPSpeculativeEngine
    from rlpost.rollout.precision import rollout_converter

    model = _tiny_llama(7)
    target = HFRolloutEngine(model, _Tok(), share_weights=False, convert=rollout_converter("int8"))
    eng = MTPSpeculativeEngine(target, MTPDraftHead(model).bound_to(target.model), switch_batch=8)
    own = {k: v.clone() for k, v in eng.head.state_dict().items()}
    old_copy = target.model
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # an "update" of the policy
    eng.sync_weights(model)
    assert target.model is not old_copy and eng.head.policy is target.model
    assert all(torch.equal(v, eng.head.state_dict()[k]) for k, v in own.items())  # fixed, as in Bebop
    g = eng.generate([[1, 2], [3]], SamplingParams(max_new_tokens=4, seed=2))
    assert eng.pop_metrics()["spec/spec_tokens"] == g.num_tokens


def test_reused_run_dir_head_names_settings_it_was_not_fitted_with(tmp_path, caplog):
    import logging

    from rlpost.rollout.mtp_draft import mtp_engine

    model = _tiny_llama(8).requires_grad_(False)
    cfg = _mtp_cfg(mtp_head_steps=2)
    mtp_engine(cfg, HFRolloutEngine(model, _Tok()), spec_config(cfg.rollout.speculative), run_dir=tmp_path,
               prompts=_prompts)
    cfg2 = _mtp_cfg(mtp_head_steps=2, mtp_head_loss="ce")
    with caplog.at_level(logging.INFO, logger="rlpost"):
        mtp_engine(cfg2, HFRolloutEngine(model, _Tok()), spec_config(cfg2.rollout.speculative), run_dir=tmp_path)
    assert "mtp_head_loss='ce' (file: 'tv')" in caplog.text and "mtp_head_steps" not in caplog.text
