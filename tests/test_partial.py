"""Partial rollouts (APRIL arXiv:2509.18521; CoPRIS): carry-over buffer, stitching, cross-stage IS, config errors."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_overrides
from rlpost.partial import PartialRolloutBuffer, continue_round, num_requests, stitch
from rlpost.rollout.base import GenerationResult, SamplingParams
from rlpost.rollout.hf import left_pad

EOS = 1


class ScriptEngine:
    """Deterministic engine: prompt ``[L, ...]`` has the full answer ``10, 11, ..., 10+L-2, EOS`` (L tokens).

    Continuing from ``prompt + partial`` emits the next tokens of that answer.
    Every sampled token's log-prob is ``self.lp`` (changed between rounds to
    stand for a newer policy). Records each call's prompts and max_new_tokens.
    """

    def __init__(self) -> None:
        self.lp = -0.25
        self.calls = []

    def generate(self, prompts, params: SamplingParams) -> GenerationResult:
        self.calls.append(([list(p) for p in prompts], params.max_new_tokens))
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
        return GenerationResult(ids, pm, resp, mask, self.lp * mask, mask.clone(), fin, [""] * B)


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
    assert buf.remaining(buf.pending()[0]) == 1
    continue_round(buf, eng, params, version=2, chunk_tokens=3)
    assert eng.calls[-1][1] == 1  # capped by what is left of max_new_tokens
    sb = buf.pop_ready()
    assert sb.response_ids.tolist() == [[10, 11, 12, 13, 14, 15, 16]]
    assert sb.finished.tolist() == [False] and sb.token_version.tolist() == [[0, 0, 0, 1, 1, 1, 2]]
    assert len(buf) == 0
    with pytest.raises(ValueError, match="chunk_tokens"):
        continue_round(buf, eng, params, version=3, chunk_tokens=0)


def test_partial_rollout_config_errors(compose):
    from rlpost.errors import ConfigError
    from rlpost.executor import build_executor

    cfg = compose(tiny_overrides("executor=async"))
    assert cfg.executor.partial_rollout is False and cfg.executor.over_provision == 1.0
    cases = [
        (("executor=async", "executor.partial_rollout=true", "executor.over_provision=0.5"), "over_provision"),
        (("executor=async", "executor.partial_rollout=true", "executor.partial_chunk_tokens=0"), "partial_chunk_tokens"),
        (("executor=sync", "executor.partial_rollout=true"), "needs executor=async"),
        (("executor=async", "executor.partial_rollout=true", "executor.over_provision=1.5"), "not wired"),
    ]
    for extra, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            build_executor(compose(tiny_overrides(*extra)), run=None)
