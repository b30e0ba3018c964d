"""Partial rollouts in real runs on model=tiny (APRIL arXiv:2509.18521; CoPRIS arXiv:2511.05589).

One round that finishes everything reproduces plain rollouts bit for bit; with
carry-over, batches hold only complete groups, carried responses stitch tokens
of several policy versions whose log-probs are those of the version that
sampled them, and the carry-over buffer survives a checkpoint and resume.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_overrides

VOLATILE = ("time/", "throughput/", "memory/", "async/", "bench/")
# A stop string most random tokens of the tiny model contain: responses end after a few tokens,
# at different lengths, so groups complete in different rounds and some carry over.
CARRY = ("executor.partial_rollout=true", "executor.partial_chunk_tokens=2", "executor.over_provision=2",
         "rollout.stop=[e]")


def _run(compose, tmp_path, name, *extra):
    from rlpost.run.runner import train

    cfg = compose(tiny_overrides("steps=3", "eval.at_end=false", "checkpoint.every=0", *extra))
    train(cfg, tmp_path / name)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _stable(rec):
    return {k: v for k, v in rec.items() if not k.startswith(VOLATILE) and not k.startswith("partial/")}


def test_one_round_partial_rollouts_equal_plain_rollouts(compose, tmp_path):
    """chunk >= max_new_tokens and no over-provisioning: every group finishes in its step's only round."""
    plain = _run(compose, tmp_path, "plain", "executor=sync")
    one_round = ("executor.partial_rollout=true", "executor.partial_chunk_tokens=12", "executor.over_provision=1")
    for ex in (("executor=sync",), ("executor=async", "executor.max_staleness=0")):
        part = _run(compose, tmp_path, ex[0].split("=")[1], *ex, *one_round)
        assert [r["step"] for r in part] == [r["step"] for r in plain] == [1, 2, 3]  # zip cannot drop a step
        for a, b in zip(plain, part):
            a, b = _stable(a), _stable(b)
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] == b[k], (ex, a["step"], k, a[k], b[k])  # bit-identical
        for r in part:
            assert r["partial/rounds"] == 1 and r["partial/carried_groups"] == 0 and r["partial/resumed_frac"] == 0
    assert plain[2]["rollout/policy_version"] == 2.0  # the weights did change between steps


def test_carried_groups_are_whole_and_keep_per_version_logprobs(compose, tmp_path, monkeypatch):
    import rlpost.run.runner as runner

    real_learn = runner.Run.learn
    seen = []

    def learn(self, c, sync_engine=True):
        b = c.batch
        lp, _ = self.trainer.compute_logprobs(b)  # the learner's weights = the weights of this step's rounds (sync)
        seen.append((c.step, self.trainer.version, b.select(list(range(len(b)))), lp))
        return real_learn(self, c, sync_engine)

    monkeypatch.setattr(runner.Run, "learn", learn)
    recs = _run(compose, tmp_path, "carry", "executor=sync", "steps=4", "trainer.lr=1e-3",
                "algo.entropy_coef=0.1", *CARRY)  # rewards are ~0 on tiny: entropy moves the weights
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    n, max_new = 4, 12
    multi, old_gaps = 0, []
    for step, version, b, lp in seen:
        m = b.response_mask > 0
        # whole groups only: 4 prompts x 4 rows, and every row ended (stop/EOS) or used the whole budget
        counts = torch.bincount(b.group_index)
        assert counts.tolist() == [n] * 4, (step, counts)
        # (a row cut off mid-way would have neither the stop string nor the full length)
        texts = b.response_texts
        assert all("e" in t or int(k) == max_new for t, k in zip(texts, m.sum(-1))), (step, texts)
        tv = b.extras["token_version"]
        assert bool((tv[~m] == -1).all()) and bool((tv[m] >= 0).all()) and bool((tv[m] <= version).all())
        # versions never decrease along a response; the row's version is its oldest token's
        for row in range(len(b)):
            v = tv[row][m[row]]
            assert bool((v[1:] >= v[:-1]).all())
            assert int(b.policy_version[row]) == int(v.min())
            if len(set(v.tolist())) > 1:
                multi += 1
        # tokens sampled by the current weights carry exactly these weights' log-probs;
        # carried tokens carry their older version's (which the update since then has moved)
        cur = m & (tv == version)
        assert cur.any()
        assert float((lp - b.rollout_logprobs)[cur].abs().max()) < 1e-4, step
        if (m & (tv < version)).any():
            old_gaps.append(float((lp - b.rollout_logprobs)[m & (tv < version)].abs().max()))
    assert multi > 0, "no response spanned two policy versions"
    assert old_gaps and max(old_gaps) > 1e-3, old_gaps
    assert max(r["partial/multi_version_frac"] for r in recs) > 0
    assert max(r["partial/token_staleness_max"] for r in recs) >= 1
    assert all(r["partial/carried_groups"] > 0 for r in recs)  # over-provisioned groups wait in the buffer


def test_async_partial_rollouts_run_several_steps(compose, tmp_path):
    """Decoupled PPO with A-3PO's proximal policy, per token from the stitched versions, over 2 mini-batches."""
    recs = _run(compose, tmp_path, "async", "executor=async", "executor.max_staleness=1", "steps=4",
                "algo.loss=decoupled_ppo", "algo.mini_batches=2", "+algo.offpolicy.proximal=a3po", *CARRY)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert r["actor/behav_weight_mean"] > 0 and r["actor/grad_norm"] == r["actor/grad_norm"]  # finite
        assert r["rollout/batch_rows"] == 16 and r["rollout/batch_prompts"] == 4
        assert r["async/staleness_hist_0"] + r["async/staleness_hist_1"] + r["async/staleness_hist_over_k"] \
            == pytest.approx(1.0)
        assert r["partial/token_staleness_max"] >= r["partial/token_staleness_mean"] >= 0


def test_partial_buffer_is_checkpointed_and_resumed(compose, tmp_path, monkeypatch):
    import rlpost.run.runner as runner
    from rlpost.run.runner import train

    extra = ("executor=sync", "steps=4", "checkpoint.every=2", *CARRY)
    straight = _run(compose, tmp_path, "straight", *extra)

    class Stop(Exception):
        pass

    real_ckpt = runner.Run.checkpoint

    def ckpt_then_die(self):
        path = real_ckpt(self)
        if self.step == 2:
            raise Stop
        return path

    monkeypatch.setattr(runner.Run, "checkpoint", ckpt_then_die)
    run_dir = tmp_path / "killed"
    with pytest.raises(Stop):
        train(compose(tiny_overrides("eval.at_end=false", *extra)), run_dir)
    monkeypatch.setattr(runner.Run, "checkpoint", real_ckpt)
    state = torch.load(run_dir / "checkpoints" / "step_000002" / "state.pt", weights_only=False)
    assert len(state["partial"]["buffer"]["entries"]) > 0  # the buffer held carried responses at the checkpoint
    train(compose(tiny_overrides("eval.at_end=false", f"resume={run_dir}", *extra)), run_dir)
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[2]["partial/carried_in_groups"] == straight[2]["partial/carried_in_groups"] > 0
    assert len(straight) == len(resumed)  # zip cannot drop a step
    for a, b in zip(straight, resumed):
        a = {k: v for k, v in a.items() if not k.startswith(VOLATILE)}
        b = {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
