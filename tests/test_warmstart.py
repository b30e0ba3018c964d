"""The warm start: calculator demonstrations laid out token for token as episodes, and SFT steps that fit them."""

from __future__ import annotations

import pytest
import torch

from rlpost.core.errors import ConfigError
from rlpost.experiments.warmstart import build_demonstration, calculator_turns, demonstration_nll, warm_start


@pytest.fixture(scope="module")
def setup():
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import load_policy
    from rlpost.tasks import build_task
    from tests.conftest import tiny_overrides

    cfg = compose_config(tiny_overrides("+recipe=agent_multiply_grpo"))
    task = build_task(cfg.task)
    model, tok = load_policy(cfg.model, torch.float32, seed=0)
    return cfg, task, model, tok


def _demo(cfg, task, tok, ex):
    from rlpost.envs import make_env

    env = make_env(cfg.sampler.params.env, dict(cfg.sampler.params.env_params))
    env.reset(ex)
    return build_demonstration(task, ex, tok, env, tok.eos_token_id)


def test_demonstration_is_the_chat_template_rendering_with_loss_on_model_turns_only(setup):
    cfg, task, _, tok = setup
    ex = task.train_examples()[0]
    d = _demo(cfg, task, tok, ex)
    a, b = (int(x) for x in ex.meta["entry"]["metadata"]["expression"].split(" * "))
    msgs = [{"role": "system", "content": cfg.task.system_prompt}, {"role": "user", "content": task.user_message(ex)},
            {"role": "assistant", "content": d.turns[0]}, {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": d.turns[1]}]
    assert tok.decode(d.prompt_ids + d.response_ids) == tok.apply_chat_template(msgs, tokenize=False).rstrip("\n")
    model_text = tok.decode([t for t, m in zip(d.response_ids, d.loss_mask) if m])
    assert model_text == d.turns[0] + d.turns[1] + tok.eos_token
    assert d.turns[1] == f"{a} * {b} = {a * b}" and task.score(d.turns[1], ex) == 1.0
    assert len(d.loss_mask) == len(d.response_ids) and 0 < sum(d.loss_mask) < len(d.loss_mask)


def test_demonstration_nll_counts_only_masked_tokens(setup):
    cfg, task, model, tok = setup
    d = _demo(cfg, task, tok, task.train_examples()[1])
    with torch.no_grad():
        nll = demonstration_nll(model, [d], tok.pad_token_id)
        ids = torch.tensor([d.prompt_ids + d.response_ids])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        tgt = ids[0, 1:]
        per = -lp.gather(-1, tgt[:, None]).squeeze(-1)[len(d.prompt_ids) - 1:]
        m = torch.tensor(d.loss_mask)
    assert torch.allclose(nll, (per * m).sum() / m.sum(), atol=1e-5)


def test_warm_start_lowers_the_demonstrations_nll(setup):
    cfg, task, model, tok = setup
    demos = [_demo(cfg, task, tok, ex) for ex in task.train_examples()[:4]]
    losses = warm_start(model, demos, tok.pad_token_id, steps=6, batch_size=4, lr=3e-3, log=None)
    assert losses[-1] < losses[0] - 1.0  # 10.8 -> 9.2 nats on the random tiny model


def test_non_arithmetic_examples_are_refused():
    from rlpost.tasks.base import Example

    with pytest.raises(ConfigError, match="expression"):
        calculator_turns(Example(0, "Write a poem.", "x"))
