"""Partial rollouts (APRIL arXiv:2509.18521; CoPRIS): carry-over buffer, stitching, cross-stage IS, config errors."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from rlpost.core.partial import PartialRolloutBuffer, continue_round, num_requests, stitch
from rlpost.rollout.base import GenerationResult, SamplingParams
from rlpost.rollout.hf import left_pad

EOS = 1


class ScriptEngine:
    """Deterministic engine: prompt ``[L, ...]`` has the full answer ``10, 11, ..., 10+L-2, EOS`` (L tokens).

    Continuing from ``prompt + partial`` emits the next tokens of that answer.
    Every sampled token's log-prob is ``self.lp`` (changed between rounds to
    stand for a newer policy). Records each call's prompts and max_new_tokens
    (``calls``) and seeds (``seeds``).
    """

    def __init__(self) -> None:
        self.lp = -0.25
        self.calls = []
        self.seeds = []

    def generate(self, prompts, params: SamplingParams) -> GenerationResult:
        self.calls.append(([list(p) for p in prompts], params.max_new_tokens))
        self.seeds.append(params.seed)
        B, R = len(prompts), params.max_new_tokens
        resp = torch.zeros(B, R, dtype=torch.long)
        mask = torch.zeros(B, R)
        fin = torch.zeros(B, dtype=torch.bool)
        for b, ctx in enumerate(prompts):
            L = ctx[0]
            answer = [10 + j for j in range(L - 1)] + [EOS]
            done = len(ctx) - 2  # prompts are 2 tokens long
            nxt = answer[done: done + R]
            resp[b, : len(nxt)] = torch.tensor(nxt)
            mask[b, : len(nxt)] = 1
            fin[b] = bool(nxt) and nxt[-1] == EOS
        ids, pm = left_pad(prompts, 0)
        return GenerationResult(ids, pm, resp, mask, self.lp * mask, 0.5 * mask, fin, [""] * B)


def test_num_requests_over_provisions_and_counts_carried_groups():
    assert num_requests(4, 1.0, 0) == 4
    assert num_requests(4, 1.5, 0) == 6
    assert num_requests(3, 1.5, 0) == 5  # ceil(4.5)
    assert num_requests(4, 1.5, 2) == 4
    assert num_requests(4, 1.5, 9) == 0
    with pytest.raises(ValueError, match="over_provision"):
        num_requests(4, 0.5, 0)


def test_extend_stitch_keeps_ids_logprobs_and_versions_exactly():
    buf = PartialRolloutBuffer(max_new_tokens=6)
    g = buf.add_group([7, 8], size=1, meta={"idx": 3})
    (i,) = buf.pending()
    buf.extend(i, [20, 21], [-0.5, -1.25], version=0, finished=False)
    assert buf.context(i) == [7, 8, 20, 21]
    assert buf.remaining(i) == 4
    buf.extend(i, [22, EOS], [-0.125, -2.0], version=2, finished=True)
    assert buf.pending() == []
    sb = buf.pop_ready()
    assert len(buf) == 0  # finished entries leave the buffer
    assert sb.response_ids.tolist() == [[20, 21, 22, EOS]]
    assert sb.rollout_logprobs.tolist() == [[-0.5, -1.25, -0.125, -2.0]]
    assert sb.token_version.tolist() == [[0, 0, 2, 2]]
    assert sb.response_mask.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert sb.finished.tolist() == [True] and sb.group.tolist() == [g] and sb.meta == [{"idx": 3}]
    assert sb.temperatures is None and sb.rounds.tolist() == [2]  # extended without temperatures, in 2 chunks
    assert sb.prompt_ids.tolist() == [[7, 8]]
    # staleness of carried tokens against trainer version 3
    assert sb.token_staleness(3).tolist() == [[3, 3, 1, 1]]
    with pytest.raises(ValueError, match="newer"):
        sb.token_staleness(1)
    # cross-stage IS: per-token ratio against the stage that sampled each token
    cur = torch.tensor([[-0.5, -1.0, -0.125, -1.0]])
    assert sb.cross_stage_log_ratio(cur).tolist() == [[0.0, 0.25, 0.0, 1.0]]


def test_entry_never_exceeds_max_new_tokens():
    buf = PartialRolloutBuffer(max_new_tokens=3)
    buf.add_group([5, 5], size=1)
    (i,) = buf.pending()
    with pytest.raises(ValueError, match="exceeds"):
        buf.extend(i, [1, 2, 3, 4], [0.0] * 4, version=0, finished=False)
    buf.extend(i, [30, 31, 32], [-1.0] * 3, version=0, finished=False)
    assert buf.pending() == []  # truncated at the budget: done, not finished
    with pytest.raises(ValueError, match="done"):
        buf.extend(i, [33], [-1.0], version=1, finished=False)
    sb = buf.pop_ready()
    assert sb.finished.tolist() == [False] and sb.response_mask.sum().item() == 3


def test_groups_are_released_whole_and_padding_is_clean():
    buf = PartialRolloutBuffer(max_new_tokens=8, pad_id=0)
    g0 = buf.add_group([4, 4], size=2)
    g1 = buf.add_group([9, 9, 9], size=1)
    a, b, c = buf.pending()
    buf.extend(a, [10, EOS], [-0.1, -0.2], 0, True)
    assert buf.ready_groups() == [] and buf.pop_ready() is None  # b still running
    buf.extend(c, [EOS], [-0.3], 0, True)
    assert buf.ready_groups() == [g1]
    buf.extend(b, [10, 11, 12], [-0.4, -0.5, -0.6], 1, False)
    sb = buf.pop_ready()
    assert sb.group.tolist() == [g1] and len(buf) == 2  # g0 stays, with its finished member
    buf.extend(b, [EOS], [-0.7], 2, True)
    sb = buf.pop_ready()
    assert sb.group.tolist() == [g0, g0] and len(buf) == 0
    assert sb.response_ids.tolist() == [[10, EOS, 0, 0], [10, 11, 12, EOS]]
    assert sb.token_version.tolist() == [[0, 0, -1, -1], [1, 1, 1, 2]]
    assert sb.rollout_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0])
    assert sb.token_staleness(2).tolist() == [[2, 2, 0, 0], [1, 1, 1, 0]]
    with pytest.raises(ValueError):
        stitch([])
    with pytest.raises(ValueError):
        buf.add_group([1], size=0)


def test_continue_round_resumes_from_partial_response_under_newer_policy():
    eng = ScriptEngine()
    buf = PartialRolloutBuffer(max_new_tokens=7)
    for L in (2, 5, 9):  # 9 > max_new_tokens: ends truncated
        buf.add_group([L, 0], size=1)
    params = SamplingParams(max_new_tokens=999, seed=5)
    n = continue_round(buf, eng, params, version=0, chunk_tokens=3)
    assert n == 2 + 3 + 3
    assert [mx for _, mx in eng.calls] == [3]
    first = buf.pop_ready()
    assert first.response_ids.tolist() == [[10, EOS]] and first.finished.tolist() == [True]
    eng.lp = -0.75  # the policy moved on
    n = continue_round(buf, eng, params, version=1, chunk_tokens=3)
    assert n == 2 + 3
    assert eng.calls[-1][0] == [[5, 0, 10, 11, 12], [9, 0, 10, 11, 12]]  # prompt + partial response
    sb = buf.pop_ready()
    assert sb.response_ids.tolist() == [[10, 11, 12, 13, EOS]]
    assert sb.rollout_logprobs.tolist() == [[-0.25, -0.25, -0.25, -0.75, -0.75]]
    assert sb.token_version.tolist() == [[0, 0, 0, 1, 1]]
    assert sb.temperatures.tolist() == [[0.5] * 5] and sb.rounds.tolist() == [2]
    assert eng.seeds == [5, 5]  # one limit per round: the round's own seed
    assert buf.remaining(buf.pending()[0]) == 1
    continue_round(buf, eng, params, version=2, chunk_tokens=3)
    assert eng.calls[-1][1] == 1  # capped by what is left of max_new_tokens
    sb = buf.pop_ready()
    assert sb.response_ids.tolist() == [[10, 11, 12, 13, 14, 15, 16]]
    assert sb.finished.tolist() == [False] and sb.token_version.tolist() == [[0, 0, 0, 1, 1, 1, 2]]
    assert len(buf) == 0
    with pytest.raises(ValueError, match="chunk_tokens"):
        continue_round(buf, eng, params, version=3, chunk_tokens=0)


def test_round_with_two_limits_calls_largest_first_with_offset_seeds():
    eng = ScriptEngine()
    buf = PartialRolloutBuffer(max_new_tokens=5)
    buf.add_group([9, 0], size=1)
    buf.add_group([9, 0], size=1)
    a, b = buf.pending()
    buf.extend(a, [10, 11, 12, 13], [-0.1] * 4, version=0, finished=False)  # 1 token left
    n = continue_round(buf, eng, SamplingParams(seed=100), version=1, chunk_tokens=3)
    assert n == 3 + 1
    assert [mx for _, mx in eng.calls] == [3, 1] and eng.seeds == [100, 100 + 1_000_003]
    assert continue_round(buf, eng, SamplingParams(seed=None), version=2, chunk_tokens=3) == 2
    assert eng.seeds[-1] is None  # unseeded stays unseeded


def test_buffer_state_dict_round_trip_keeps_entries_and_keys():
    import io

    buf = PartialRolloutBuffer(max_new_tokens=6)
    buf.add_group([4, 4], size=2, meta={"prompt_index": 7})
    a, b = buf.pending()
    buf.extend(a, [20, EOS], [-0.5, -1.0], version=3, finished=True, temperatures=[0.7, 0.7])
    buf.extend(b, [21], [-2.0], version=3, finished=False, temperatures=[0.7])
    f = io.BytesIO()
    torch.save(buf.state_dict(), f)
    f.seek(0)
    other = PartialRolloutBuffer(max_new_tokens=6)
    other.load_state_dict(torch.load(f, weights_only=False))
    assert other.pending() == [b] and other.context(b) == [4, 4, 21]
    other.extend(b, [EOS], [-0.25], version=4, finished=True, temperatures=[0.7])
    assert other.add_group([1, 1], size=1) == 1  # group keys continue after the saved ones
    sb = other.pop_ready(1)
    assert sb.response_ids.tolist() == [[20, EOS], [21, EOS]]
    assert sb.token_version.tolist() == [[3, 3], [3, 4]] and sb.rollout_logprobs.tolist() == [[-0.5, -1.0], [-2.0, -0.25]]
    assert torch.allclose(sb.temperatures, torch.full((2, 2), 0.7)) and sb.meta[0] == {"prompt_index": 7}
    with pytest.raises(ValueError, match="max_new_tokens"):
        PartialRolloutBuffer(max_new_tokens=5).load_state_dict(buf.state_dict())


def _producer_steps():
    """Three APRIL steps of the producer on the scripted engine, with a checkpoint round trip after step 2.

    needed 2 groups, groups of 2, over_provision 1.5 (3 in flight), chunks of 3, max 8 tokens.
    Prompt index L answers with L tokens (L - 1 tokens, then EOS).
    """
    import io

    from rlpost.core.partial import PartialRolloutProducer

    eng = ScriptEngine()
    batches = [[2, 9, 3, 5], [4, 6, 7, 2]]
    calls = []

    def select():
        calls.append(1)
        return batches[len(calls) - 1]

    def encode(i):
        return [i, 0]

    prod = PartialRolloutProducer(max_new_tokens=8, group_size=2, over_provision=1.5, chunk_tokens=3)
    s1 = prod.produce(2, select, encode, eng, SamplingParams(seed=11), version=0, weights_step=0)
    eng.lp = -0.75  # the trainer took 4 optimizer steps (one RL step)
    s2 = prod.produce(2, select, encode, eng, SamplingParams(seed=22), version=4, weights_step=1)
    f = io.BytesIO()
    torch.save(prod.state_dict(), f)
    f.seek(0)
    restored = PartialRolloutProducer(max_new_tokens=8, group_size=2, over_provision=1.5, chunk_tokens=3)
    restored.load_state_dict(torch.load(f, weights_only=False))
    s3 = prod.produce(2, select, encode, eng, SamplingParams(seed=33), version=8, weights_step=2)
    r3 = restored.produce(2, select, encode, eng, SamplingParams(seed=33), version=8, weights_step=2)
    return eng, calls, prod, (s1, s2, s3, r3)


def test_producer_trains_on_first_complete_groups_and_carries_the_rest():
    eng, calls, prod, (s1, s2, s3, r3) = _producer_steps()
    # step 1: 3 groups (L = 2, 9, 3); after one round of 3 tokens L=2 and L=3 are complete
    assert s1.prompt_index == [2, 2, 3, 3] and s1.rounds == 1 and s1.new_groups == 3
    assert s1.batch.response_ids.tolist() == [[10, EOS, 0], [10, EOS, 0], [10, 11, EOS], [10, 11, EOS]]
    assert s1.metrics["partial/carried_groups"] == 1 and s1.metrics["partial/carried_tokens"] == 6
    assert s1.metrics["partial/queued_prompts"] == 1 and s1.tokens == 2 * 2 + 3 * 2 + 3 * 2
    # step 2: L=9 continues (now under version 4) next to 2 new groups (L = 5, 4); two rounds until
    # 2 groups are complete; the oldest two (L=9 truncated at 8 tokens, L=5) are trained on
    assert s2.prompt_index == [9, 9, 5, 5] and s2.rounds == 2 and s2.new_groups == 2
    assert s2.batch.response_ids[0].tolist() == [10, 11, 12, 13, 14, 15, 16, 17]
    assert s2.batch.finished.tolist() == [False, False, True, True]
    assert s2.batch.token_version[0].tolist() == [0, 0, 0, 4, 4, 4, 4, 4]
    assert s2.batch.rollout_logprobs[0].tolist() == [-0.25] * 3 + [-0.75] * 5
    assert s2.token_step[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]  # versions mapped to RL steps
    assert s2.token_step[2].tolist() == [1, 1, 1, 1, 1, -1, -1, -1]
    assert s2.batch.rounds.tolist() == [3, 3, 2, 2]
    m = s2.metrics
    assert m["partial/resumed_frac"] == 0.5 and m["partial/multi_version_frac"] == 0.5
    assert m["partial/rounds_mean"] == 2.5 and m["partial/carried_in_groups"] == 1
    assert m["partial/carried_groups"] == 1 and m["partial/tokens_generated"] == 3 * 6 + 2 * 2 + 1 * 2 + 2 * 2
    # round 2 of step 2: limit 3 (L=5, L=4) first, then limit 2 (what L=9 has left), seeds offset
    assert eng.seeds[1:4] == [22, 22 + 7919, 22 + 7919 + 1_000_003]
    assert prod.version_step == {8: 2}  # after step 3 only version 8 tokens (L=7) are left: 0 and 4 dropped
    # step 3: the L=4 group finished in step 2 comes first (complete but one step old), then L=6
    assert s3.prompt_index == [4, 4, 6, 6] and s3.metrics["partial/resumed_frac"] == 0.0
    assert s3.batch.token_version[0].tolist() == [4, 4, 4, 4, -1, -1] and s3.token_step[0, :4].tolist() == [1] * 4
    assert len(calls) == 2 and prod.queue == [2]
    for sb in (s1.batch, s2.batch, s3.batch):  # whole groups only, each member done
        assert sb.group.tolist()[0::2] == sb.group.tolist()[1::2]
        assert all(f or n == 8 for f, n in zip(sb.finished.tolist(), sb.response_mask.sum(-1).tolist()))


def test_producer_state_round_trip_continues_identically():
    _, _, _, (_, _, s3, r3) = _producer_steps()
    assert r3.prompt_index == s3.prompt_index and r3.metrics == s3.metrics
    for a, b in ((s3.batch.response_ids, r3.batch.response_ids), (s3.batch.token_version, r3.batch.token_version),
                 (s3.batch.rollout_logprobs, r3.batch.rollout_logprobs), (s3.token_step, r3.token_step)):
        assert torch.equal(a, b)


def test_partial_rollout_config_errors(compose):
    from rlpost.config.compose import validate_config
    from rlpost.core.errors import ConfigError
    from rlpost.run.executor import build_executor, check_partial

    cfg = compose(tiny_overrides("executor=async"))
    assert cfg.executor.partial_rollout is False and cfg.executor.over_provision == 1.0
    on = ("executor.partial_rollout=true",)
    cases = [
        (("executor=async", *on, "executor.over_provision=0.5"), "over_provision"),
        (("executor=async", *on, "executor.partial_chunk_tokens=0"), "partial_chunk_tokens"),
        (("executor=sync", *on, "sampler=tree"), "sampler=tree"),
        (("executor=async", *on, "selector=dynamic_filter"), "group filtering"),
        (("executor=async", *on, "selector=cures"), "rollout allocation"),
        (("executor=async", *on, "selector=seele"), "hints"),
        (("executor=async", *on, "selector=popo"), "batch replay"),
    ]
    for extra, msg in cases:
        bad = compose(tiny_overrides(*extra))
        with pytest.raises(ConfigError, match=msg):
            check_partial(bad)
        with pytest.raises(ConfigError, match=msg):  # refused before any model is loaded
            validate_config(bad)
    with pytest.raises(ConfigError, match="uniform"):  # the message lists selectors that work
        check_partial(compose(tiny_overrides(*on, "selector=popo")))
    for ok in (("executor=sync", *on), ("executor=async", *on, "executor.over_provision=1.5", "selector=vade")):
        cfg = compose(tiny_overrides(*ok))
        check_partial(cfg)
        validate_config(cfg)
    assert type(build_executor(compose(tiny_overrides("executor=sync", *on)), run=None)).__name__ == "SyncExecutor"
