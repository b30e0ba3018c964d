"""Reward function: isolated verifiers with timeouts, shaping, TTRL majority-vote labels."""

from __future__ import annotations

import os
import time

import pytest
import torch
from omegaconf import OmegaConf

from rlpost.config.schema import RewardConfig, TaskConfig
from rlpost.rewards import RewardFunction, overlong_penalty
from rlpost.tasks import Example, Task, build_task


class ToyTask(Task):
    """Answer = the response stripped; 'hang' sleeps, 'crash' raises, 'die' kills the worker."""

    def __init__(self) -> None:
        super().__init__(OmegaConf.create({"name": "toy", "instruction": "", "system_prompt": None}))

    def train_examples(self):
        return []

    def eval_examples(self):
        return []

    def extract_answer(self, response):
        return response.strip() or None

    def score(self, response, example):
        if response == "hang":
            time.sleep(60)
        if response == "crash":
            raise RuntimeError("verifier bug")
        if response == "die":
            os._exit(3)
        if response == "nan":
            return float("nan")
        return float(response.strip() == str(example.answer))


def ex(i, ans):
    return Example(index=i, question=f"q{i}", answer=ans)


def test_hanging_and_crashing_verifiers_give_zero_within_timeout():
    rf = RewardFunction(ToyTask(), timeout_s=1.0)
    try:
        responses = ["4", "hang", "4", "crash", "die", "4", "nan"]
        examples = [ex(0, "4")] * len(responses)
        t0 = time.monotonic()
        r, m = rf(responses, examples, torch.full((len(responses),), 5))
        elapsed = time.monotonic() - t0
    finally:
        rf.close()
    assert r.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert m["reward/verifier_timeouts"] >= 1.0
    # the crash and the NaN are errors; the killed worker is either an error or a timeout
    assert m["reward/verifier_errors"] + m["reward/verifier_timeouts"] == 4.0
    # one hang (1 s) plus at most one lost worker (1 s) plus start-up; nowhere near the 60 s sleep
    assert elapsed < 10.0


def test_shaping_format_overlong_and_length_penalty():
    rf = RewardFunction(ToyTask(), format_weight=0.5, overlong_buffer=4, overlong_penalty=1.0, max_len=10,
                        length_penalty=0.01, isolate=False)
    lengths = torch.tensor([2, 8, 10])
    r, m = rf(["4", "4", " "], [ex(0, "4")] * 3, lengths)
    # correct + 0.5 format; overlong window starts at 6: len 8 -> -0.5, len 10 -> -1; minus 0.01 * len
    expected = torch.tensor([1.5 - 0.02, 1.5 - 0.5 - 0.08, 0.0 - 1.0 - 0.10])
    assert torch.allclose(r, expected, atol=1e-6)
    assert m["reward/correct_mean"] == pytest.approx(2 / 3)
    assert m["reward/format_mean"] == pytest.approx(2 / 3)


def test_overlong_penalty_closed_form():
    # DAPO Eq. 13 with L_max = 20, L_cache = 5: 0 up to 15, linear to -1 at 20, -1 beyond
    pen = overlong_penalty(torch.tensor([10, 15, 16, 18, 20, 25]), max_len=20, buffer=5)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0]))
    assert overlong_penalty(torch.tensor([30]), 20, 0).tolist() == [0.0]


def test_from_config_reads_every_setting():
    cfg = RewardConfig(timeout_s=2.0, format_weight=0.1, overlong_buffer=8, overlong_penalty=0.5, length_penalty=0.001,
                       majority_vote=True)
    rf = RewardFunction.from_config(ToyTask(), OmegaConf.structured(cfg), max_len=64)
    assert (rf.timeout_s, rf.format_weight, rf.overlong_buffer, rf.overlong_pen, rf.max_len, rf.length_penalty) == (
        2.0, 0.1, 8, 0.5, 64, 0.001)
    assert rf.majority_vote


def test_ttrl_majority_vote_pseudo_labels():
    rf = RewardFunction(ToyTask(), majority_vote=True, isolate=False)
    # prompt 0 (gold 4): votes 5,5,4,5 -> label 5 (wrong); prompt 1 (gold 7): 7,7,3,"" -> label 7 (right)
    responses = ["5", "5", "4", "5", "7", "7", "3", " "]
    examples = [ex(0, "4")] * 4 + [ex(1, "7")] * 4
    r, m = rf(responses, examples, torch.ones(8, dtype=torch.long))
    assert r.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert m["reward/ttrl_label_accuracy"] == 0.5
    assert m["reward/ttrl_majority_ratio"] == pytest.approx((3 / 4 + 2 / 4) / 2)
    assert m["reward/gold_correct_mean"] == pytest.approx(3 / 8)


def test_ttrl_on_a_reasoning_gym_task_rewrites_the_entry():
    cfg = OmegaConf.structured(TaskConfig(train_size=4, eval_size=1, answer_format="tags"))
    task = build_task(cfg)
    e = task.train_examples()[0]
    wrong = str(int(e.answer) + 1)
    rf = RewardFunction(task, majority_vote=True, isolate=False)
    responses = [f"<answer>{wrong}</answer>"] * 2 + [f"<answer>{e.answer}</answer>"]
    r, m = rf(responses, [e] * 3, torch.ones(3, dtype=torch.long))
    assert r.tolist() == [1.0, 1.0, 0.0]
    assert m["reward/ttrl_label_accuracy"] == 0.0


def test_worker_killed_while_idle_is_replaced_and_close_never_blocks():
    """A worker killed between calls (SIGKILL from outside, as an OOM killer would) costs the next
    response one verifier error, is replaced, and close() returns at once."""
    import signal

    rf = RewardFunction(ToyTask(), timeout_s=5.0)
    try:
        r, _ = rf(["4"], [ex(0, "4")], torch.full((1,), 5))
        assert r.tolist() == [1.0]
        os.kill(rf._pool._proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        r, m = rf(["4", "4"], [ex(0, "4")] * 2, torch.full((2,), 5))
        assert r.tolist() == [0.0, 1.0]
        assert m["reward/verifier_errors"] == 1.0 and m["reward/verifier_timeouts"] == 0.0
        os.kill(rf._pool._proc.pid, signal.SIGKILL)
        time.sleep(0.2)
    finally:
        t0 = time.monotonic()
        rf.close()
        assert time.monotonic() - t0 < 3.0
    assert rf._pool is None


def test_worker_ignores_sigterm_so_the_step_in_progress_keeps_its_verifier():
    """SIGTERM sent to the whole process group must not take the verifier away mid-step."""
    import signal

    rf = RewardFunction(ToyTask(), timeout_s=5.0)
    try:
        rf(["4"], [ex(0, "4")], torch.full((1,), 5))
        pid = rf._pool._proc.pid
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.2)
        r, m = rf(["4", "5"], [ex(0, "4")] * 2, torch.full((2,), 5))
        assert r.tolist() == [1.0, 0.0] and m["reward/verifier_errors"] == 0.0
        assert rf._pool._proc.pid == pid  # the same worker answered
    finally:
        rf.close()


def _runner_that_starts_a_worker(pid_out):
    """A stand-in runner process: start the verifier worker, report its pid, then wait to be killed."""
    rf = RewardFunction(ToyTask(), timeout_s=5.0)
    rf(["4"], [ex(0, "4")], torch.full((1,), 5))
    pid_out.send(rf._pool._proc.pid)
    time.sleep(600)


def test_worker_exits_when_its_runner_is_killed():
    """SIGKILL of the runner (a killed run, an OOM kill) must not leave the verifier worker behind: it
    held its own copy of the runner's pipe end and so waited forever for a call that never came."""
    import multiprocessing as mp
    import signal

    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    runner = ctx.Process(target=_runner_that_starts_a_worker, args=(send,))
    runner.start()
    try:
        assert recv.poll(60), "the runner did not start its verifier worker"
        worker_pid = recv.recv()
        os.kill(runner.pid, signal.SIGKILL)
        runner.join(10)

        def gone(pid):
            try:
                with open(f"/proc/{pid}/status") as f:
                    return "State:\tZ" in f.read()  # exited, waiting for init to reap it
            except FileNotFoundError:
                return True

        deadline = time.monotonic() + 10
        while not gone(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(worker_pid), f"verifier worker {worker_pid} outlived its killed runner"
    finally:
        if runner.is_alive():
            runner.kill()


def test_a_verifiers_own_time_limit_counts_as_a_timeout_on_every_path():
    """A task whose check ends at its own time limit (a sandbox's wall clock) raises VerifierTimeout: the row
    scores 0 and counts in reward/verifier_timeouts, in this process and in the forked verifier worker alike."""
    from rlpost.core.errors import VerifierTimeout
    from rlpost.rewards.scoring import verify

    class SlowCheck(ToyTask):
        def score(self, response, example):
            if response == "slow":
                raise VerifierTimeout("the sandbox's 3-s wall clock ended the tests")
            return super().score(response, example)

    assert verify(SlowCheck(), "slow", ex(0, "4")) == ("timeout", 0.0, False)
    for isolate in (False, True):
        rf = RewardFunction(SlowCheck(), timeout_s=5.0, isolate=isolate)
        try:
            r, m = rf(["4", "slow", "crash"], [ex(0, "4")] * 3, torch.full((3,), 5))
        finally:
            rf.close()
        assert r.tolist() == [1.0, 0.0, 0.0], isolate
        assert (m["reward/verifier_timeouts"], m["reward/verifier_errors"]) == (1.0, 1.0), isolate
