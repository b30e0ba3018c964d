"""Self-speculative rollouts: draft lengths by hand, config errors, exact samples of the policy, metrics and
weight sync. Moved unchanged from tests/test_rollout_self_spec_otr_hif4.py.
"""

import pytest
import torch

from rlpost.core.errors import ConfigError
from rlpost.rollout.base import SamplingParams
from rlpost.rollout.hf import HFRolloutEngine
from rlpost.rollout.self_spec import SelfSpeculativeEngine, next_draft_len, spec_config
from spec_helpers import _Tok, _exact_dist, _perturb, _tiny_llama, response_chi2

pytestmark = pytest.mark.usefixtures("one_thread")


def test_next_draft_len_hand_computed():
    assert next_draft_len(4, 4, 4, 1, 8) == 6  # all accepted: +2
    assert next_draft_len(7, 3, 3, 1, 8) == 8  # clipped at the maximum
    assert next_draft_len(4, 1, 4, 1, 8) == 3  # a rejection: -1
    assert next_draft_len(1, 0, 1, 1, 8) == 1  # clipped at the minimum
    with pytest.raises(ValueError, match="accepted"):
        next_draft_len(4, 5, 4, 1, 8)
    with pytest.raises(ValueError, match="bounds"):
        next_draft_len(4, 1, 4, 3, 2)


def test_spec_config_errors():
    assert spec_config({"switch_batch": 2})["drafter"] == "int8"
    with pytest.raises(ConfigError, match="unknown key"):
        spec_config({"switch_batchh": 2})
    with pytest.raises(ConfigError, match="drafter"):
        spec_config({"drafter": "fp3"})
    with pytest.raises(ConfigError, match="min_draft_len"):
        spec_config({"draft_len": 9, "max_draft_len": 8})


def test_self_speculative_rollouts_are_exact_samples_of_the_policy():
    """Whole 3-token responses: chi-square against the policy's exact distribution, in both phases."""
    model = _tiny_llama(0)
    target = HFRolloutEngine(model, _Tok(), batch_size=4096)
    N, T, prompt = 400, 3, [1, 2, 3]
    # switch_batch = N - 1: the batch draws its first token autoregressively, and the rows still
    # running after it (most) are speculated, so both phases and the switch are exercised
    eng = SelfSpeculativeEngine(target, _perturb(0.3), switch_batch=N - 1, draft_len=2, max_draft_len=3)
    g = eng.generate([prompt] * N, SamplingParams(max_new_tokens=T, seed=7))
    m = eng.pop_metrics()
    assert m["spec/spec_rows"] > N // 2 and m["spec/ar_tokens"] == N
    assert 0.05 < m["spec/accept_rate"] < 0.95, m  # drafter differs from the policy: some rejections
    keys, p_exact = _exact_dist(model, prompt, T)
    _, q_exact = _exact_dist(eng.drafter, prompt, T)
    stat, bound, against = response_chi2(g, keys, p_exact)
    assert stat < bound, (stat, bound)
    # the test has power: the drafter's own distribution is rejected
    assert against(q_exact) > bound
    # reported log-probs are the policy's
    lp0 = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), -1)
    first = g.response_ids[:, 0]
    assert torch.allclose(g.rollout_logprobs[:, 0].double(), lp0[first], atol=1e-4)


def test_self_speculative_metrics_and_sync():
    model = _tiny_llama(1)
    target = HFRolloutEngine(model, _Tok(), share_weights=True)
    from rlpost.rollout.precision import rollout_converter

    eng = SelfSpeculativeEngine(target, rollout_converter("fp8_sim"), switch_batch=8, draft_len=3)
    g = eng.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=6, seed=1))
    m = eng.pop_metrics()
    assert m["spec/spec_rows"] == 2 and m["spec/ar_tokens"] == 0  # 2 rows <= 8: speculation from the start
    assert m["spec/spec_tokens"] == g.num_tokens
    # an fp8 drafter of the same weights agrees almost always
    assert m["spec/accept_rate"] > 0.8
    # each round (one policy forward after the row's prefill) emits its accepted tokens + 1 at most
    assert m["spec/spec_tokens"] <= m["spec/accepted_tokens"] + m["spec/target_forwards"] - 2
    assert eng.pop_metrics()["spec/draft_tokens"] == 0  # reset
    # same seed, same samples
    g2 = eng.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=6, seed=1))
    assert torch.equal(g.response_ids, g2.response_ids)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.0)
    eng.sync_weights(model)
    assert float(eng.drafter.lm_head.weight.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="temperature hook"):
        eng.generate([[1]], SamplingParams(temperature_hook=lambda lg, t: None))


def test_speculative_config_wiring():
    from omegaconf import OmegaConf

    from rlpost.rollout.self_spec import check_speculative

    cfg = OmegaConf.create({"rollout": {"engine": "vllm", "speculative": {"switch_batch": 2}},
                            "model": {"routing_replay": "off"}})
    with pytest.raises(ConfigError, match="rollout=hf"):
        check_speculative(cfg)
    cfg = OmegaConf.create({"rollout": {"engine": "hf", "speculative": {"switch_batch": 2}},
                            "model": {"routing_replay": "replay"}})
    with pytest.raises(ConfigError, match="routing_replay"):
        check_speculative(cfg)
    cfg = OmegaConf.create({"rollout": {"engine": "hf", "speculative": None}, "model": {}})
    assert check_speculative(cfg) is None
