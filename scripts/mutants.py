#!/usr/bin/env python
"""Mutation check of rlpost's core: single-line faults, each applied, tested and reverted.

Issue #46 asks for a mutation check built before any test is removed: each entry of
:data:`FAULTS` is one small, genuine semantic fault in the core (a clip bound flipped, padding
counted in the token-mean, the weight push skipped, a checkpoint field not restored, ...). For
each fault this script

1. checks that the fault's ``find`` fragment occurs exactly once in its file (else it stops
   with an error naming the fault: the source moved and the fault must be rewritten);
2. applies the one-line patch in the checkout named by ``--root`` and checks that the patched
   module still imports;
3. runs pytest there, first on the fault's ``first`` tests (the likely catchers, stage 1), and
   with ``--full``, if they do not catch it, on the whole suite, every marker included, fast
   files first (stage 2); each pytest run has a timeout, so one hang does not block the rest;
4. records the first failing test's node id (from the JUnit XML pytest writes, else the
   ``FAILED ...`` line of its output) and the stage that caught the fault;
5. restores the file byte for byte (always: in a ``finally``, also on Ctrl-C or an error) and
   checks that it is identical to the original.

It never touches the repository it lives in unless ``--root`` names it (the default): use a
separate worktree when others run tests in this one, e.g.
``git worktree add /tmp/mut HEAD``.

Usage::

    python scripts/mutants.py --list
    python scripts/mutants.py --root /tmp/mut [--only ID,ID] [--json OUT] [--full]
        [--timeout 900] [--stage2-timeout 3600] [--durations JUNIT.xml] [--python PY]

The result is a markdown table: id | category | fault | caught by | stage | seconds.
``--durations`` takes a JUnit XML of a full run (``pytest --junitxml``) to order stage 2's
files from the fastest up; without it, files with ``slow`` / ``vllm`` tests run last.
The exit status is 0 when every fault that ran was caught, 1 otherwise, 2 on a usage or
patch error.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Fault:
    """One single-line fault.

    Attributes:
        id: short slug (``--only`` takes these).
        category: what part of the method it breaks (clip, masking, groups, ...).
        file: the file it patches, relative to the repository root.
        find: the exact source fragment replaced; it must occur exactly once in ``file``
            and lie on one line.
        replace: its replacement (one line).
        means: one line saying what the fault means for a user.
        first: the test files (or node ids) to try first, likely catchers first.
    """

    id: str
    category: str
    file: str
    find: str
    replace: str
    means: str
    first: Tuple[str, ...]


T = "tests/"
FAULTS: Tuple[Fault, ...] = (
    # ---------------------------------------------------------------- clip bounds
    Fault("clip-eps-swapped", "clip", "rlpost/algos/losses.py",
          "clipped = torch.clamp(ratio, 1.0 - lo, 1.0 + hi)",
          "clipped = torch.clamp(ratio, 1.0 - hi, 1.0 + lo)",
          "PPO's eps_low and eps_high swapped (DAPO's clip-higher widens the wrong side)",
          (T + "test_algos_losses.py", T + "test_estimators_losses_by_hand.py")),
    Fault("clip-low-bound-sign", "clip", "rlpost/algos/losses.py",
          "clipped = torch.clamp(ratio, 1.0 - lo, 1.0 + hi)",
          "clipped = torch.clamp(ratio, 1.0 + lo, 1.0 + hi)",
          "PPO's lower clip bound flipped to 1 + eps_low",
          (T + "test_algos_losses.py", T + "test_estimators_losses_by_hand.py")),
    Fault("clip-max-to-min", "clip", "rlpost/algos/losses.py",
          "loss = torch.maximum(surr1, surr2)",
          "loss = torch.minimum(surr1, surr2)",
          "PPO takes the optimistic instead of the pessimistic surrogate (the clip never binds)",
          (T + "test_algos_losses.py", T + "test_estimators_losses_by_hand.py")),
    Fault("dual-clip-sign", "clip", "rlpost/algos/losses.py",
          "loss = torch.where(A < 0, torch.minimum(loss, surr3), loss)",
          "loss = torch.where(A > 0, torch.minimum(loss, surr3), loss)",
          "dual clip caps the positive-advantage tokens instead of the negative ones",
          (T + "test_algos_losses.py",)),
    # ---------------------------------------------------------------- masking / aggregation
    Fault("token-mean-pad-numerator", "masking", "rlpost/algos/aggregation.py",
          "return (loss_mat * mask).sum() / _denom(mask.sum(), denom)",
          "return loss_mat.sum() / _denom(mask.sum(), denom)",
          "token-mean sums the loss of padding tokens too",
          (T + "test_aggregation_by_hand.py", T + "test_algos_losses.py")),
    Fault("token-mean-pad-denominator", "masking", "rlpost/algos/aggregation.py",
          "return float(mask.sum())",
          "return float(mask.numel())",
          "the trainer's token-mean denominator counts padding positions",
          (T + "test_aggregation_by_hand.py", T + "test_trainer_gradient_by_hand.py", T + "test_algos_losses.py",
           T + "test_microbatch_invariance.py")),
    Fault("prompt-in-sft-mask", "masking", "rlpost/experiments/warmstart.py",
          "w[i, len(d.prompt_ids): len(r)] = torch.tensor(d.loss_mask)",
          "w[i, : len(r)] = torch.tensor([1.0] * len(d.prompt_ids) + d.loss_mask)",
          "the SFT warm start's loss mask covers the prompt tokens too",
          (T + "test_warmstart.py",)),
    Fault("seq-count-includes-empty", "aggregation", "rlpost/algos/aggregation.py",
          "return (mask.sum(-1) > 0).sum().to(mask.dtype if mask.is_floating_point() else torch.float32)",
          "return torch.tensor(float(mask.shape[0]))",
          "seq-* aggregations count all-masked (padding) rows in their denominator",
          (T + "test_aggregation_by_hand.py", T + "test_trainer_gradient_by_hand.py", T + "test_algos_losses.py",
           T + "test_microbatch_invariance.py")),
    Fault("seq-norm-const-ignored", "aggregation", "rlpost/algos/aggregation.py",
          "c = float(norm_const) if norm_const else float(loss_mat.shape[-1])",
          "c = float(loss_mat.shape[-1])",
          "Dr. GRPO's seq-mean-token-sum-norm divides by the batch's padded width, not the fixed constant",
          (T + "test_aggregation_by_hand.py", T + "test_trainer_gradient_by_hand.py", T + "test_algos_losses.py",
           T + "test_microbatch_invariance.py")),
    Fault("seq-token-mean-width", "aggregation", "rlpost/algos/aggregation.py",
          "per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)",
          "per_seq = (loss_mat * mask).sum(-1) / float(mask.shape[-1])",
          "seq-mean-token-mean divides each sequence by the padded width instead of its length",
          (T + "test_aggregation_by_hand.py", T + "test_algos_losses.py", T + "test_microbatch_invariance.py")),
    # ---------------------------------------------------------------- groups
    Fault("group-rows-shifted", "groups", "rlpost/samplers/base.py",
          "group_index=torch.tensor(gi, dtype=torch.long)",
          "group_index=torch.tensor(gi[1:] + gi[-1:], dtype=torch.long)",
          "each row's group index shifted by one row (a group's last rollout joins the next prompt)",
          (T + "test_samplers.py", T + "test_pipeline.py")),
    Fault("grpo-std-over-batch", "groups", "rlpost/algos/advantages.py",
          'if str(std_scope) == "batch":',
          "if True:",
          "GRPO divides by the std over the whole batch instead of each group's",
          (T + "test_algos_advantages.py", T + "test_estimators_losses_by_hand.py")),
    Fault("group-std-population", "groups", "rlpost/algos/utils.py",
          "std = torch.where(cnt > 1, (sq / (cnt - 1).clamp(min=1)).sqrt(), torch.zeros_like(cnt))",
          "std = torch.where(cnt > 1, (sq / cnt).sqrt(), torch.zeros_like(cnt))",
          "the group std loses Bessel's correction (GRPO's reference code uses the unbiased std)",
          (T + "test_algos_advantages.py", T + "test_estimators_losses_by_hand.py")),
    Fault("rloo-scale-dropped", "groups", "rlpost/algos/advantages.py",
          "(r - mean) * cnt / (cnt - 1).clamp(min=1), torch.zeros_like(r))",
          "(r - mean), torch.zeros_like(r))",
          "RLOO's leave-one-out baseline becomes the plain group mean (G / (G - 1) factor lost)",
          (T + "test_algos_advantages.py",)),
    # ---------------------------------------------------------------- log-probs
    Fault("ref-is-policy", "logprobs", "rlpost/run/runner.py",
          'lambda b: self.trainer.compute_logprobs(b, "ref")[0])',
          'lambda b: self.trainer.compute_logprobs(b, "policy")[0])',
          "the reference log-probs are the policy's old log-probs (old and reference swapped): the KL anchor moves",
          (T + "test_kl_reference_in_runner.py", T + "test_lora.py", T + "test_value.py")),
    Fault("kl-in-reward-old-ref-swapped", "logprobs", "rlpost/run/runner.py",
          'kl = kl_penalty(a.kl.estimator, batch.extras["old_logprobs"], batch.extras["ref_logprobs"])',
          'kl = kl_penalty(a.kl.estimator, batch.extras["ref_logprobs"], batch.extras["old_logprobs"])',
          "KL-in-reward passes old and reference log-probs swapped (k1's sign flips)",
          (T + "test_kl_reference_in_runner.py", T + "test_algos_advantages.py", T + "test_algos_losses.py")),
    Fault("trainer-temperature-dropped", "logprobs", "rlpost/trainer/torch_engine.py",
          "T = self._temperature(batch)",
          "T = 1.0",
          "the trainer's log-probs ignore the sampling temperature (ratio != 1 on-policy)",
          (T + "test_trainer_gradient_by_hand.py", T + "test_sampling_parity.py",
           T + "test_runner.py::test_rollout_logprobs_match_trainer_logprobs_fp32")),
    Fault("logprob-position-shift", "logprobs", "rlpost/models/logprobs.py",
          "h = hidden[:, P - 1 : P + R - 1]",
          "h = hidden[:, P : P + R]",
          "the full-sequence forward (no shared prompt, gradient checkpointing, routing replay) scores each "
          "response token with the hidden state one position late",
          (T + "test_trainer_gradient_by_hand.py",
           T + "test_runner.py::test_shared_prefix_forward_equals_full_forward_in_values_and_gradients",
           T + "test_runner.py::test_rollout_logprobs_match_trainer_logprobs_fp32", T + "test_logprob_kernels.py")),
    # ---------------------------------------------------------------- KL
    Fault("kl-k1-sign", "kl", "rlpost/algos/regularizers.py",
          "return logprobs - ref_logprobs",
          "return ref_logprobs - logprobs",
          "the k1 KL estimate has the wrong sign (the penalty rewards drifting from the reference)",
          (T + "test_algos_losses.py",)),
    Fault("kl-k2-half", "kl", "rlpost/algos/regularizers.py",
          "return 0.5 * (logprobs - ref_logprobs) ** 2",
          "return (logprobs - ref_logprobs) ** 2",
          "the k2 KL estimate loses its factor 1/2",
          (T + "test_algos_losses.py", T + "test_estimators_losses_by_hand.py")),
    Fault("kl-k3-direction", "kl", "rlpost/algos/regularizers.py",
          "log_r = (ref_logprobs - logprobs).clamp(-clamp, clamp)",
          "log_r = (logprobs - ref_logprobs).clamp(-clamp, clamp)",
          "k3 estimates KL(ref || pi) instead of KL(pi || ref)",
          (T + "test_algos_losses.py", T + "test_objectives_release.py")),
    Fault("kl-loss-sign", "kl", "rlpost/trainer/torch_engine.py",
          "loss = loss + a.kl.coef * aggregate(a.loss_agg, kl, m",
          "loss = loss - a.kl.coef * aggregate(a.loss_agg, kl, m",
          "the KL penalty is subtracted from the loss (the update pushes away from the reference)",
          (T + "test_trainer_gradient_by_hand.py", T + "test_algos_losses.py", T + "test_lora.py")),
    # ---------------------------------------------------------------- weight push
    Fault("weight-push-skipped", "weight-sync", "rlpost/run/runner.py",
          "if ctx.sync_engine:  # else the asynchronous",
          "if ctx.sync_engine and False:  # else the asynchronous",
          "the updated weights are never pushed to the rollout engine (rollouts stay on the initial policy)",
          (T + "test_weight_push_to_rollout_copy.py", T + "test_lora.py", T + "test_precision.py")),
    Fault("weight-push-before-step", "weight-sync", "rlpost/run/runner.py",
          '"policy_update": self._policy_update, "sync": self._sync}',
          '"policy_update": self._sync, "sync": self._policy_update}',
          "the weights are pushed before the optimizer step (the engine always samples one step behind)",
          (T + "test_weight_push_to_rollout_copy.py", T + "test_lora.py", T + "test_precision.py")),
    # ---------------------------------------------------------------- checkpoints
    Fault("ckpt-optimizer-not-restored", "checkpoint", "rlpost/trainer/torch_engine.py",
          'self.opt.load_state_dict(sd["opt"])',
          'sd["opt"]  # (optimizer state not restored)',
          "resume starts AdamW from empty moments: the resumed run differs from an uninterrupted one",
          (T + "test_checkpoint_roundtrip.py", T + "test_runner.py::test_killed_and_resumed_run_matches_uninterrupted",
           T + "test_lora.py::test_lora_checkpoint_resumes_to_the_same_metrics")),
    Fault("ckpt-update-rng-not-restored", "checkpoint", "rlpost/run/checkpoint.py",
          "self.gen.set_state(sd)",
          "sd  # (generator state not restored)",
          "the mini-batch shuffling generator restarts from its seed on resume",
          (T + "test_checkpoint_roundtrip.py", T + "test_runner.py::test_killed_and_resumed_run_matches_uninterrupted",
           T + "test_resume.py")),
    Fault("ckpt-version-not-restored", "checkpoint", "rlpost/trainer/torch_engine.py",
          'self.version = int(sd.get("version", 0))',
          "self.version = 0",
          "the trainer's count of optimizer steps (policy version, per-step seeds) restarts at 0 on resume",
          (T + "test_checkpoint_roundtrip.py", T + "test_runner.py::test_killed_and_resumed_run_matches_uninterrupted",
           T + "test_lora.py::test_lora_checkpoint_resumes_to_the_same_metrics", T + "test_partial_runs.py")),
    # ---------------------------------------------------------------- rewards
    Fault("reward-row-misaligned", "reward", "rlpost/samplers/base.py",
          "res.rewards = out.total.float()",
          "res.rewards = out.total.float().roll(1)",
          "each rollout gets the reward of the row before it",
          (T + "test_pipeline.py", T + "test_samplers.py")),
    Fault("overlong-window-start", "reward", "rlpost/rewards/scoring.py",
          "start = max_len - buffer",
          "start = max_len",
          "DAPO's overlong penalty starts at the limit instead of L_max - L_cache",
          (T + "test_rewards_scoring.py",)),
    # ---------------------------------------------------------------- micro-batches
    Fault("microbatch-loss-not-scaled", "microbatch", "rlpost/trainer/torch_engine.py",
          "loss = aggregate(a.loss_agg, loss_mat, m, denom=denom,",
          "loss = aggregate(a.loss_agg, loss_mat, m, denom=None,",
          "each micro-batch's loss is its own mean, not its share of the mini-batch's "
          "(gradient scales with #micro-batches)",
          (T + "test_trainer_gradient_by_hand.py", T + "test_microbatch_invariance.py", T + "test_token_budget.py")),
    # ---------------------------------------------------------------- episodes
    Fault("episode-tool-tokens-trained", "episode", "rlpost/samplers/episode.py",
          "e.add(ins, 0.0)",
          "e.add(ins, 1.0)",
          "an episode's tool/observation tokens get loss mask 1 (the policy is trained on the environment's text)",
          (T + "test_agents.py", T + "test_episode_integrity.py")),
    # ---------------------------------------------------------------- advantages / value
    Fault("whiten-by-variance", "advantage", "rlpost/algos/utils.py",
          "out = (x64 - mean) * torch.rsqrt(var + eps)",
          "out = (x64 - mean) / (var + eps)",
          "advantage whitening divides by the variance instead of the std",
          (T + "test_algos_advantages.py",)),
    Fault("gae-lambda-dropped", "advantage", "rlpost/algos/advantages.py",
          "last = torch.where(m > 0, delta + gamma * lam * last, last)",
          "last = torch.where(m > 0, delta + gamma * last, last)",
          "GAE ignores lambda (always lambda = 1)",
          (T + "test_gae_by_hand.py", T + "test_algos_advantages.py", T + "test_value.py")),
    # ---------------------------------------------------------------- importance corrections
    Fault("tis-cap-ignored", "correction", "rlpost/algos/corrections.py",
          "w = ratio.clamp(max=cap) * response_mask",
          "w = ratio * response_mask",
          "truncated importance sampling no longer truncates (unbounded weights)",
          (T + "test_algos_corrections.py",)),
    Fault("is-ratio-inverted", "correction", "rlpost/algos/corrections.py",
          "return torch.exp((old_logprobs.detach().to(dt) - rollout_logprobs.detach().to(dt)).clamp(-clamp, clamp))",
          "return torch.exp((rollout_logprobs.detach().to(dt) - old_logprobs.detach().to(dt)).clamp(-clamp, clamp))",
          "the rollout-mismatch importance weight is pi_rollout / pi_old instead of pi_old / pi_rollout",
          (T + "test_algos_corrections.py",)),
    # ---------------------------------------------------------------- evaluation
    Fault("eval-not-greedy", "eval", "rlpost/eval/evaluate.py",
          "SamplingParams(max_new_tokens=max_new, greedy=True, seed=seed, stop=stop), batch_size, bar)",
          "SamplingParams(max_new_tokens=max_new, greedy=False, seed=seed, stop=stop), batch_size, bar)",
          "held-out accuracy is measured on sampled instead of greedy answers",
          (T + "test_eval_stats.py", T + "test_eval_engine.py")),
    Fault("pass-at-k-off-by-one", "eval", "rlpost/eval/stats.py",
          "np.arange(n - c + 1, n + 1, dtype=np.float64)",
          "np.arange(n - c, n + 1, dtype=np.float64)",
          "pass@k's product runs over one factor too many",
          (T + "test_eval_stats.py",)),
)


@dataclasses.dataclass
class Result:
    """What one fault's run found."""

    id: str
    category: str
    means: str
    caught_by: Optional[str]  # first failing test's node id, or None
    stage: Optional[int]  # 1: its ``first`` tests, 2: the rest of the suite, None: not caught
    seconds: float
    timed_out: bool = False
    note: str = ""


class PatchError(RuntimeError):
    """A fault does not apply (its fragment is not found exactly once, or spans lines)."""


def by_id(ids: Optional[Sequence[str]]) -> List[Fault]:
    """The faults named in ``ids`` (all when None), in :data:`FAULTS` order.

    Raises:
        PatchError: an unknown id, or two faults with the same id.
    """
    seen: Dict[str, Fault] = {}
    for f in FAULTS:
        if f.id in seen:
            raise PatchError(f"duplicate fault id {f.id!r}")
        seen[f.id] = f
    if not ids:
        return list(FAULTS)
    bad = [i for i in ids if i not in seen]
    if bad:
        raise PatchError(f"unknown fault id(s): {', '.join(bad)} (see --list)")
    return [f for f in FAULTS if f.id in set(ids)]


def mutated_text(fault: Fault, original: str) -> str:
    """``original`` with ``fault.find`` replaced by ``fault.replace``.

    Raises:
        PatchError: the fragment occurs zero or several times, or a side spans lines.
    """
    if "\n" in fault.find or "\n" in fault.replace:
        raise PatchError(f"{fault.id}: find/replace must be single-line fragments")
    n = original.count(fault.find)
    if n != 1:
        raise PatchError(f"{fault.id}: {fault.file} holds the fragment {fault.find!r} {n} times (needs exactly 1); "
                         "the source changed, so rewrite this fault")
    if fault.find == fault.replace:
        raise PatchError(f"{fault.id}: the replacement equals the original")
    return original.replace(fault.find, fault.replace, 1)


def module_name(file: str) -> Optional[str]:
    """The importable module of a repository-relative ``.py`` path (``rlpost/a/b.py`` -> ``rlpost.a.b``)."""
    p = Path(file)
    if p.suffix != ".py":
        return None
    parts = list(p.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


class Applied:
    """Context manager: ``fault`` applied to the checkout at ``root``, the file restored on exit.

    The original bytes and modification time are kept in memory; on exit (normal, exception or
    Ctrl-C) they are written back and the file is compared byte for byte with them. The mutant's
    modification time is forced away from the original's whole second, so a ``__pycache__`` entry
    of the original can never be taken for the mutant's (and, the time being restored, the
    original's cache stays valid afterwards).
    """

    def __init__(self, root: Path, fault: Fault) -> None:
        self.path = root / fault.file
        self.fault = fault
        self.original: Optional[bytes] = None

    def __enter__(self) -> "Applied":
        if not self.path.is_file():
            raise PatchError(f"{self.fault.id}: {self.path} not found")
        self.original = self.path.read_bytes()
        self.stat = self.path.stat()
        text = mutated_text(self.fault, self.original.decode("utf-8"))
        self.path.write_bytes(text.encode("utf-8"))
        mt = self.stat.st_mtime_ns + 2_000_000_000  # 2 s later: a different whole second for the pyc check
        os.utime(self.path, ns=(self.stat.st_atime_ns, max(mt, time.time_ns())))
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Write the original bytes back and verify them (raises RuntimeError when they differ)."""
        if self.original is None:
            return
        self.path.write_bytes(self.original)
        os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        if self.path.read_bytes() != self.original:
            raise RuntimeError(f"{self.path} differs from the original after the revert: restore it by hand "
                               f"(sha256 of the original: {hashlib.sha256(self.original).hexdigest()})")


def _env(root: Path) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant's bytecode is never cached
    return env


def check_import(root: Path, fault: Fault, python: str) -> Optional[str]:
    """Import the patched module in a fresh interpreter; returns the error text, or None when it imports."""
    mod = module_name(fault.file)
    if mod is None:
        return None
    code = (f"import importlib, sys; m = importlib.import_module({mod!r}); "
            f"sys.exit(0 if m.__file__.startswith({str(root)!r}) else 3)")
    p = subprocess.run([python, "-c", code], cwd=root, env=_env(root), capture_output=True, text=True, timeout=300)
    if p.returncode == 3:
        return f"{mod} was not imported from {root} (PYTHONPATH)"
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1]


def _node_of(case: ET.Element) -> Tuple[str, str]:
    """``(file, node id)`` of a JUnit ``testcase`` (classname ``tests.test_x[.TestClass]``, name ``test_y[param]``)."""
    parts = (case.get("classname") or "").split(".")
    i = next((k for k, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    mod = "/".join(parts[: i + 1]) + ".py"
    name = case.get("name") or ""
    return mod, "::".join([mod, *parts[i + 1:], *([name] if name else [])])


def _first_failure(junit: Path, output: str) -> Optional[str]:
    """The node id of the first failed or errored test: from the JUnit XML, else the ``FAILED``/``ERROR`` line."""
    try:
        for case in ET.parse(junit).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                return _node_of(case)[1]
    except (ET.ParseError, FileNotFoundError, OSError):
        pass
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return m.group(1) if m else None


def run_pytest(root: Path, targets: Sequence[str], python: str, timeout: float,
               extra: Sequence[str] = ()) -> Tuple[bool, Optional[str], bool, str]:
    """Run ``pytest -x`` on ``targets`` in ``root``; returns ``(failed, first failing node id, timed out, tail)``.

    The run gets its own process group, killed on timeout or Ctrl-C.
    """
    with tempfile.TemporaryDirectory(prefix="mutants_") as td:
        junit = Path(td) / "junit.xml"
        cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={junit}", *extra, *targets]
        proc = subprocess.Popen(cmd, cwd=root, env=_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        # only exit 1 (tests failed) is a catch: 2-4 are an interrupted run, an internal error or a usage error
        # (a target that does not exist), 5 no tests collected
        if proc.returncode in (2, 3, 4) and not timed_out:
            raise RuntimeError(f"pytest exit {proc.returncode} in {root} for {' '.join(targets)} (not a catch; "
                               f"fix the fault's first tests):\n{out[-1500:]}")
        failed = proc.returncode == 1 and not timed_out
        node = _first_failure(junit, out) if failed else None
        if failed and node is None:
            node = f"pytest exit {proc.returncode} (no failing test named)"
        return failed, node, timed_out, out[-3000:]


def _has_marks(path: Path) -> bool:
    try:
        return bool(re.search(r"mark\.(slow|vllm)|pytestmark", path.read_text(encoding="utf-8")))
    except OSError:
        return False


def suite_order(root: Path, durations: Optional[Path]) -> List[str]:
    """Every test file under ``root/tests``, fastest first.

    With a JUnit XML of a full run (``durations``), by its summed test time (unknown files first);
    else files without ``slow`` / ``vllm`` marks first, each part by file size.
    """
    files = sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py"))
    if durations is not None and durations.is_file():
        per: Dict[str, float] = {}
        for case in ET.parse(durations).getroot().iter("testcase"):
            f = _node_of(case)[0]
            per[f] = per.get(f, 0.0) + float(case.get("time", 0) or 0)
        return sorted(files, key=lambda f: (per.get(f, 0.0), f))
    return sorted(files, key=lambda f: (_has_marks(root / f), (root / f).stat().st_size, f))


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _file_of(target: str) -> str:
    return target.split("::", 1)[0]


def run_fault(root: Path, fault: Fault, python: str, timeout: float, full: bool, stage2_timeout: float,
              order: List[str]) -> Result:
    """Apply ``fault`` in ``root``, run its stages, restore the file; returns the :class:`Result`."""
    t0 = time.monotonic()
    res = Result(fault.id, fault.category, fault.means, None, None, 0.0)
    with Applied(root, fault):
        err = check_import(root, fault, python)
        if err is not None:
            raise PatchError(f"{fault.id}: the patched module does not import: {err}")
        first = [t for t in fault.first if (root / _file_of(t)).is_file()]
        missing = [t for t in fault.first if t not in first]
        if missing:  # e.g. a test added after the checkout's commit: absent there, so it cannot catch
            res.note = "absent here: " + ", ".join(_file_of(t) for t in missing)
        failed, node, to = (run_pytest(root, first, python, timeout)[:3] if first else (False, None, False))
        if failed:
            res.caught_by, res.stage = node, 1
        elif full:
            res.timed_out = to
            # stage 2: the rest of the suite (a stage-1 node id's file runs whole again: its other tests)
            done = {t for t in fault.first if "::" not in t}
            rest = [f for f in order if f not in done]
            failed, node, to2 = run_pytest(root, rest, python, stage2_timeout)[:3]
            if failed:
                res.caught_by, res.stage = node, 2
            res.timed_out = res.timed_out or to2
            if to2:
                res.note = _join(res.note, f"stage 2 stopped at its {stage2_timeout:.0f} s cap")
        else:
            res.timed_out = to
        if to:
            res.note = _join(res.note, f"stage 1 stopped at its {timeout:.0f} s cap")
    res.seconds = time.monotonic() - t0
    return res


def table(results: Sequence[Result]) -> str:
    """The markdown table of ``results``."""
    lines = ["| id | category | fault | caught by | stage | seconds |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        caught = f"`{r.caught_by}`" if r.caught_by else "NOT CAUGHT" + (f" ({r.note})" if r.note else "")
        cells = (r.id, r.category, r.means, caught, str(r.stage or "-"), f"{r.seconds:.0f}")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # KL(a || b) stays one cell
    n = sum(1 for r in results if r.caught_by)
    lines.append("")
    lines.append(f"{n} of {len(results)} faults caught.")
    return "\n".join(lines)


def list_faults(faults: Sequence[Fault]) -> str:
    """One block per fault: id, category, file, the line change, what it means and its first tests."""
    out = []
    for f in faults:
        out.append(f"{f.id}  [{f.category}]  {f.file}\n    - {f.find}\n    + {f.replace}\n"
                   f"    {f.means}\n    first: {' '.join(f.first)}")
    return "\n".join(out) + f"\n\n{len(faults)} faults"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the faults and exit")
    ap.add_argument("--root", type=Path, default=REPO, help="checkout to mutate and test (default: this repository)")
    ap.add_argument("--only", default="", help="comma-separated fault ids")
    ap.add_argument("--json", type=Path, help="write the results as JSON here")
    ap.add_argument("--full", action="store_true", help="run the rest of the suite when the first tests miss a fault")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per stage-1 pytest run (default 900)")
    ap.add_argument("--stage2-timeout", type=float, default=3600.0,
                    help="seconds for one fault's stage-2 run of the rest of the suite (default 3600)")
    ap.add_argument("--durations", type=Path, help="JUnit XML of a full run: orders stage 2 fastest file first")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest (default: this one)")
    ap.add_argument("--check", action="store_true", help="only apply each fault, import it and restore (no tests)")
    a = ap.parse_args(argv)
    try:
        faults = by_id([s for s in a.only.split(",") if s.strip()] or None)
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.list:
        print(list_faults(faults))
        return 0
    root = a.root.resolve()
    if not (root / "rlpost").is_dir() or not (root / "tests").is_dir():
        print(f"error: {root} is not an rlpost checkout (no rlpost/ and tests/)", file=sys.stderr)
        return 2
    # every fault must apply before anything runs
    for f in faults:
        try:
            mutated_text(f, (root / f.file).read_text(encoding="utf-8"))
        except (PatchError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if a.check:
        for f in faults:
            with Applied(root, f):
                err = check_import(root, f, a.python)
            print(f"{f.id}: {'imports' if err is None else 'IMPORT ERROR ' + err}")
        return 0
    order = suite_order(root, a.durations)
    results: List[Result] = []
    try:
        for i, f in enumerate(faults, 1):
            print(f"[{i}/{len(faults)}] {f.id} ({f.file}) ...", file=sys.stderr, flush=True)
            try:
                r = run_fault(root, f, a.python, a.timeout, a.full, a.stage2_timeout, order)
            except PatchError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            results.append(r)
            print(f"    -> {r.caught_by or 'NOT CAUGHT'} (stage {r.stage or '-'}, {r.seconds:.0f} s)",
                  file=sys.stderr, flush=True)
            if a.json:  # written after every fault, so an interrupted run keeps what it found
                a.json.write_text(json.dumps([dataclasses.asdict(x) for x in results], indent=1) + "\n")
    except KeyboardInterrupt:
        print("interrupted: the current fault was reverted", file=sys.stderr)
    print(table(results))
    return 0 if results and all(r.caught_by for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
