"""Distillation from a frozen teacher (``model.teacher``): the top-K truncated reverse KL of
Revisiting On-Policy Distillation (arXiv:2603.25562), the teacher's loading and its stage."""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import tiny_overrides, update_with_gradient  # noqa: E402
from ds_worker import make_batch  # noqa: E402

from rlpost.algos.aggregation import aggregate  # noqa: E402
from rlpost.algos.distill import truncated_reverse_kl  # noqa: E402
from rlpost.algos.losses import PolicyLossInput, compute_policy_loss  # noqa: E402
from rlpost.core.errors import ConfigError  # noqa: E402

# Two response positions, vocabulary of 5 (hand case). Position 0: the teacher prefers token 1 over 0
# by one logit, the student the reverse; position 1: both identical.
STUDENT_LOGITS = torch.tensor([[[2.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0, 1.0]]])
TEACHER_LOGITS = torch.tensor([[[1.0, 2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 3.0, 0.0, 1.0]]])


def _hand_input(mask, teacher_logits=TEACHER_LOGITS, k=2):
    """PolicyLossInput of the hand case with K = 2: the teacher's top-2 ids and both models' log-probs there."""
    t_lp = torch.log_softmax(teacher_logits, -1)
    vals, ids = t_lp.topk(k, -1)
    logits = STUDENT_LOGITS.clone().requires_grad_(True)
    s_sup = torch.log_softmax(logits, -1).gather(-1, ids)
    lp = torch.zeros(1, 2)
    inp = PolicyLossInput(logprobs=lp, old_logprobs=lp, advantages=torch.zeros(1, 2), response_mask=mask, extras={'support_logprobs': s_sup, 'teacher_support_logprobs': vals})
    return inp, logits, ids


def test_topk_reverse_kl_hand_values_two_tokens_vocab_five():
    mask = torch.ones(1, 2)
    inp, logits, ids = _hand_input(mask)
    assert ids[0, 0].tolist() == [1, 0] and ids[0, 1].tolist() == [2, 4]  # the teacher's top-2 per position
    loss, met = compute_policy_loss("topk_reverse_kl", inp, top_k=2)
    # position 0, renormalised over {1, 0}: teacher (s(1), s(-1)), student (s(-1), s(1)) with s the logistic;
    # KL = (s(1) - s(-1)) * ln(s(1)/s(-1)) = tanh(1/2) * 1.  Position 1: identical distributions -> 0.
    assert loss[0, 0].item() == pytest.approx(math.tanh(0.5), abs=1e-6)
    assert loss[0, 1].item() == pytest.approx(0.0, abs=1e-7)
    assert met["opd/topk_reverse_kl"].item() == pytest.approx(math.tanh(0.5) / 2, abs=1e-6)
    # without renormalisation: full-vocabulary probabilities, Z = e^2 + e + 3 for both models, so
    # p_s(0) ln(p_s(0)/q(0)) + p_s(1) ln(p_s(1)/q(1)) = (e^2 * 1 + e * (-1)) / Z
    raw, _ = compute_policy_loss("topk_reverse_kl", inp, top_k=2, renormalise=False)
    e = math.e
    assert raw[0, 0].item() == pytest.approx((e * e - e) / (e * e + e + 3), abs=1e-6)


def test_topk_reverse_kl_gradient_only_on_support_tokens_of_response_positions():
    # position 1 is padding; the teacher disagrees there, so it would have a gradient if unmasked
    teacher = torch.tensor([[[1.0, 2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 3.0]]])
    mask = torch.tensor([[1.0, 0.0]])
    inp, logits, _ = _hand_input(mask, teacher)
    loss, _ = compute_policy_loss("topk_reverse_kl", inp, top_k=2)
    aggregate("token-mean", loss, mask).backward()
    g = logits.grad[0]
    # d KL / d z_v = p_hat(v) (log p_hat(v) - log q_hat(v) - KL) on the support {0, 1}; the full-vocabulary
    # normaliser cancels in the renormalisation, so tokens 2..4 get none; the padded position none at all.
    s1, sm1, kl = 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1)), math.tanh(0.5)
    assert g[0, 0].item() == pytest.approx(s1 * (1 - kl), abs=1e-6)
    assert g[0, 1].item() == pytest.approx(sm1 * (-1 - kl), abs=1e-6)
    assert g[0, 2:].abs().max() < 1e-7 and torch.all(g[1] == 0)  # 2..4: zero up to float rounding


def test_truncated_reverse_kl_is_zero_for_equal_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    a = torch.log_softmax(torch.randn(4, 7, generator=g), -1)
    b = torch.log_softmax(torch.randn(4, 7, generator=g), -1)
    assert torch.allclose(truncated_reverse_kl(a, a), torch.zeros(4), atol=1e-7)
    assert bool((truncated_reverse_kl(a, b) > 0).all())
    # K = full vocabulary, no renormalisation needed: the exact reverse KL
    full = (a.exp() * (a - b)).sum(-1)
    assert torch.allclose(truncated_reverse_kl(a, b, renormalise=False), full, atol=1e-6)
    assert torch.allclose(truncated_reverse_kl(a, b, renormalise=True), full, atol=1e-6)


def _tiny():
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_policy

    return load_policy(ModelConfig(source="tiny"), seed=3)[0]


def test_support_logprobs_match_a_plain_forward_and_response_logprobs():
    from rlpost.models.logprobs import build_inputs, response_logprobs
    from rlpost.models.teacher import support_logprobs

    model = _tiny().eval()
    b = make_batch(B=4)
    attn = (b.response_mask > 0).long()
    with torch.no_grad():
        lp, ent, sup, ids = support_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, attn,
                                             temperature=0.7, k_top=3, with_entropy=True)
        ref_lp, ref_ent = response_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, attn,
                                            temperature=0.7, with_entropy=True)
        x, am, pos = build_inputs(b.prompt_ids, b.prompt_mask, b.response_ids, attn)
        P, R = b.prompt_ids.shape[1], b.response_ids.shape[1]
        full = torch.log_softmax(model(input_ids=x, attention_mask=am, position_ids=pos).logits[:, P - 1:P + R - 1] / 0.7, -1)
        vals, want_ids = full.topk(3, -1)
        # student side: log-probs at given ids (the teacher's top-3) from the same single pass
        _, _, at_ids, _ = support_logprobs(model, b.prompt_ids, b.prompt_mask, b.response_ids, attn,
                                           temperature=0.7, support_ids=want_ids)
    m = attn.bool()
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert torch.equal(ids[m], want_ids[m])
    assert torch.allclose(sup[m], vals[m], atol=1e-5) and torch.allclose(at_ids[m], vals[m], atol=1e-5)
    assert torch.all(sup[~m] == 0) and torch.all(ids[~m] == 0)
    assert bool((sup[m][:, :-1] >= sup[m][:, 1:]).all())  # descending


def _opd_trainer(compose, mb: int):
    from rlpost.models.teacher import Teacher
    from rlpost.trainer.torch_engine import TorchTrainer

    cfg = compose(tiny_overrides("algo=opd", "model.teacher=tiny", f"trainer.micro_batch_size={mb}",
                                 "trainer.grad_clip=0", "algo.loss_params.top_k=4"))
    model = _tiny()
    return TorchTrainer.from_config(copy.deepcopy(model), cfg, "cpu"), Teacher(copy.deepcopy(model), "tiny")


def _update(t, teacher, b):
    b.extras.update(teacher.score(b, t, top_k=4))
    return update_with_gradient(t, b)


def test_teacher_equal_to_student_gives_zero_loss_and_zero_gradient(compose):
    t, teacher = _opd_trainer(compose, 8)
    assert not any(p.requires_grad for p in teacher.module.parameters()) and not teacher.module.training
    b = make_batch(B=8)
    m, g = _update(t, teacher, b)
    assert b.extras["teacher_topk_ids"].shape == (8, 6, 4)
    assert m["loss/policy"] == pytest.approx(0.0, abs=1e-7) and m["opd/topk_reverse_kl"] == pytest.approx(0.0, abs=1e-7)
    assert g.abs().max().item() < 1e-6
    assert m["opd/teacher_topk_mass"] == pytest.approx(m["opd/student_topk_mass"], rel=1e-5)


def test_distinct_teacher_gradient_does_not_depend_on_micro_batch_size(compose):
    """A teacher with other weights: nonzero loss, and the same gradient for micro-batches of 1, 3 and 8 rows."""
    out = {}
    for mb in (1, 3, 8):
        t, teacher = _opd_trainer(compose, mb)
        with torch.no_grad():
            for p in teacher.module.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        b = make_batch(B=8)
        b.response_mask[5] = 0
        out[mb] = _update(t, teacher, b)
    m8, g8 = out[8]
    assert m8["loss/policy"] > 1e-4 and g8.norm() > 0
    for mb in (1, 3):
        m, g = out[mb]
        assert torch.allclose(g, g8, rtol=1e-4, atol=1e-7), (mb, (g - g8).abs().max())
        assert m["loss/policy"] == pytest.approx(m8["loss/policy"], rel=1e-4)


def test_config_errors_name_the_fix(compose):
    from rlpost.config.compose import validate_config

    with pytest.raises(ConfigError, match="model.teacher is not set"):
        validate_config(compose(tiny_overrides("algo=opd")))
    with pytest.raises(ConfigError, match="uses no teacher"):
        validate_config(compose(tiny_overrides("algo=grpo", "model.teacher=tiny")))
    with pytest.raises(ConfigError, match="neither a model preset"):
        validate_config(compose(tiny_overrides("algo=opd", "model.teacher=no-such-model")))
    validate_config(compose(tiny_overrides("algo=opd", "model.teacher=tiny")))


def test_check_tokenizers_refuses_a_different_vocabulary():
    from rlpost.models.teacher import check_tokenizers

    a = SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1})
    check_tokenizers(a, SimpleNamespace(get_vocab=lambda: {"a": 0, "b": 1}))
    with pytest.raises(ConfigError, match="tokenizer differs"):
        check_tokenizers(a, SimpleNamespace(get_vocab=lambda: {"a": 1, "b": 0}))


def test_load_teacher_from_a_directory_checks_its_tokenizer(tmp_path):
    """A saved HF directory loads frozen in the requested dtype; one with an extra token is refused."""
    from rlpost.config.schema import ModelConfig
    from rlpost.models.loader import load_tokenizer
    from rlpost.models.teacher import load_teacher

    model, tok = _tiny(), load_tokenizer(ModelConfig(source="tiny"))
    model.save_pretrained(tmp_path / "same")
    tok.save_pretrained(tmp_path / "same")
    teacher = load_teacher(str(tmp_path / "same"), tok, torch.bfloat16, "cpu")
    assert next(teacher.module.parameters()).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in teacher.module.parameters())
    other = copy.deepcopy(tok)
    other.add_tokens(["<not-in-the-student>"])
    model.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match="tokenizer differs"):
        load_teacher(str(tmp_path / "other"), tok, torch.float32, "cpu")


def test_opd_run_scores_with_the_teacher_stage(compose, tmp_path):
    """Two steps of algo=opd on model=tiny with itself as teacher: the stage runs, the first loss is 0."""
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=opd", "model.teacher=tiny", "steps=2", "selector.prompts_per_step=2",
                                 "algo.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "eval.at_end=false",
                                 "checkpoint.every=0"))
    train(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss/policy" in r]
    assert len(rows) == 2
    assert rows[0]["opd/topk_reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(rows[0]["teacher/logprob_gap"]) < 1e-4
    assert all(math.isfinite(r["loss/policy"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)


@pytest.mark.slow
def test_smollm2_as_its_own_teacher_two_steps(compose, tmp_path):
    """Real model: SmolLM2-135M distilled from a frozen copy of itself; loss ~0 and finite."""
    from rlpost.run.runner import train

    cfg = compose(["model=smollm2-135m", "algo=opd", "model.teacher=smollm2-135m", "steps=2", "logger=jsonl",
                   "selector.prompts_per_step=2", "algo.n_samples_per_prompt=2", "rollout.max_new_tokens=16",
                   "eval.at_start=false", "eval.at_end=false", "checkpoint.every=0", "precision=fp32"])
    train(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss/policy" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss/policy"]) for r in rows)
    assert rows[0]["opd/topk_reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert rows[1]["opd/topk_reverse_kl"] < 1e-3


def test_opd_token_advantage_hand_values():
    """Sampled-token OPD (the paper's baseline): A_t = log q(y_t) - log pi_old(y_t), 0 on padding."""
    from rlpost.algos.advantages import AdvantageInput, compute_advantages

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    x = AdvantageInput(rewards=torch.tensor([1.0]), response_mask=mask, group_index=torch.tensor([0]),
                       teacher_logprobs=torch.tensor([[-1.0, -2.0, -7.0]]),
                       rollout_logprobs=torch.tensor([[-1.5, -1.0, -1.0]]))
    assert torch.allclose(compute_advantages("opd_token", x).advantages, torch.tensor([[0.5, -1.0, 0.0]]))
    x.old_logprobs = torch.tensor([[-1.0, -2.5, 0.0]])  # the trainer's pre-update log-probs win when present
    assert torch.allclose(compute_advantages("opd_token", x).advantages, torch.tensor([[0.0, 0.5, 0.0]]))
    x.teacher_logprobs = None
    with pytest.raises(ValueError, match="model.teacher"):
        compute_advantages("opd_token", x)


def test_sampled_token_opd_reads_the_teacher_stage(compose, tmp_path):
    """algo.adv_estimator=opd_token with ppo_clip: the runner hands the teacher's log-probs to the estimator;
    with the student as its own teacher every advantage of step 1 is 0."""
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("algo=opd", "algo.adv_estimator=opd_token", "algo.loss=ppo_clip",
                                 "model.teacher=tiny", "steps=1", "selector.prompts_per_step=2",
                                 "algo.n_samples_per_prompt=2", "rollout.max_new_tokens=6", "eval.at_end=false",
                                 "checkpoint.every=0"))
    train(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    row = [r for r in rows if "adv/mean" in r][0]
    assert abs(row["adv/mean"]) < 1e-4 and math.isfinite(row["loss/policy"])
