#!/usr/bin/env python
"""rlpost vs TRL's GRPOTrainer on one config, steps interleaved, in one invocation.

Both runners train SmolLM2-135M-Instruct (rlpost's converted copy in
``$RLPOST_CACHE`` / ``~/.cache/rlpost``) on the arithmetic task with GRPO: 8 prompts
x 4 samples per step, up to 32 new tokens, temperature 1, lr 2e-5, one optimizer
step per batch, no KL term, fp32 (rlpost: the given ``--rlpost-precision``, default
``auto``; TRL: its defaults otherwise, gradient checkpointing included). The
reward is the task's rule in both: 1 when the last number of the response equals
the answer, else 0 (TRL gets it re-implemented, as it cannot import rlpost's verifier
without rlpost's dependencies).

Each runner is its own process (so peak RSS is its own): rlpost in this Python,
TRL in ``--trl-python`` (a virtual environment with ``trl`` and the same torch;
create it with ``python -m venv /work/trlvenv && /work/trlvenv/bin/pip install
torch==2.13.0 trl``). The parent releases one step at a time, alternating between
the two, so background load hits both alike. Prints per-step seconds, then a
table of medians over steps 2..N (rollout = generation; update = the rest of the
step), the ratios, and each process's peak RSS.

    python scripts/bench_vs_trl.py --steps 4 [--trl-python /work/trlvenv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# this checkout's rlpost, not an installed copy
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS, SAMPLES, NEW_TOKENS, LR = 8, 4, 32, 2e-5


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _emit(d: dict) -> None:
    sys.stdout.write("RESULT " + json.dumps(d) + "\n")
    sys.stdout.flush()


def _wait_go() -> bool:
    line = sys.stdin.readline()
    return line.strip() == "go"


# ------------------------------------------------------------------ rlpost worker
def rlpost_worker(steps: int, precision: str, data_path: str) -> None:
    import tempfile

    import torch

    from rlpost.config.compose import compose_config
    from rlpost.run.runner import Run

    cfg = compose_config([
        f"precision={precision}", "logger=none", f"steps={steps}", "model=smollm2-135m", "task=arithmetic",
        f"selector.prompts_per_step={PROMPTS}", f"algo.n_samples_per_prompt={SAMPLES}",
        f"rollout.max_new_tokens={NEW_TOKENS}", f"trainer.lr={LR}", "trainer.micro_batch_size=32",
    ])
    with tempfile.TemporaryDirectory() as d:
        run = Run(cfg, Path(d))
        # hand the same prompts (rendered by rlpost) and answers to the TRL worker
        ex = run.train_examples
        rows = [{"prompt": run.tokenizer.decode(run.prompt_ids(i)), "answer": str(ex[i].answer)} for i in range(len(ex))]
        Path(data_path).write_text(json.dumps(rows))
        _emit({"ready": True, "precision": f"{cfg.precision.trainer_dtype}/{cfg.precision.rollout_dtype}",
               "threads": torch.get_num_threads()})
        try:
            for _ in range(steps):
                if not _wait_go():
                    break
                m = run.train_step()
                # update = everything after generation (reward, advantages, update, weight sync), as for TRL
                _emit({"step_s": m["time/step_s"], "rollout_s": m["time/rollout_s"],
                       "update_s": m["time/step_s"] - m["time/rollout_s"], "reward_s": m["time/reward_s"],
                       "train_s": m["time/update_s"], "rss_mb": _rss_mb(),
                       "tokens": m.get("bench/update_tokens"), "reward": m["reward/mean"]})
        finally:
            run.close()


# ------------------------------------------------------------------ TRL worker
def trl_worker(steps: int, data_path: str, model_dir: str) -> None:
    import re

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = json.loads(Path(data_path).read_text())
    ds = Dataset.from_list(rows)

    def reward(completions, answer, **_):
        out = []
        for c, a in zip(completions, answer):
            nums = re.findall(r"-?\d+(?:\.\d+)?", c if isinstance(c, str) else str(c))
            out.append(1.0 if nums and nums[-1] == a else 0.0)
        return out

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out_dir = Path(data_path).parent / "trl_out"
    args = GRPOConfig(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES, max_completion_length=NEW_TOKENS, temperature=1.0, learning_rate=LR,
        beta=0.0, num_iterations=1, gradient_accumulation_steps=1, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0, dataloader_num_workers=0,
    )
    gen_time = [0.0]
    orig_generate = model.generate

    def timed_generate(*a, **k):
        t = time.perf_counter()
        try:
            return orig_generate(*a, **k)
        finally:
            gen_time[0] += time.perf_counter() - t

    model.generate = timed_generate

    class Gate(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, *a, **k):
            _wait_go()
            gen_time[0] = 0.0
            Gate.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            dt = time.perf_counter() - Gate.t0
            _emit({"step_s": dt, "rollout_s": gen_time[0], "update_s": dt - gen_time[0], "rss_mb": _rss_mb()})

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Gate()])
    _emit({"ready": True, "precision": "fp32", "threads": torch.get_num_threads(),
           "gradient_checkpointing": bool(args.gradient_checkpointing)})
    trainer.train()


# ------------------------------------------------------------------ parent
class Worker:
    def __init__(self, name: str, cmd: list, env: dict) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.rows: list = []
        self.info = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"{self.name} worker exited (code {self.proc.wait()}) before reporting")

    def step(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        r = self._read()
        self.rows.append(r)
        return r

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trl-python", default="/work/trlvenv/bin/python")
    ap.add_argument("--rlpost-precision", default="auto")
    ap.add_argument("--worker", choices=["rlpost", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "rlpost":
        return rlpost_worker(args.steps, args.rlpost_precision, args.data)
    if args.worker == "trl":
        return trl_worker(args.steps, args.data, args.model_dir)

    import tempfile

    cache = Path(os.environ.get("RLPOST_CACHE", Path.home() / ".cache" / "rlpost")) / "smollm2-135m-instruct"
    if not Path(args.trl_python).exists():
        sys.exit(f"error: --trl-python {args.trl_python} not found. Fix: python -m venv /work/trlvenv && "
                 "/work/trlvenv/bin/pip install torch==2.13.0 trl")
    me = str(Path(__file__).resolve())
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
    with tempfile.TemporaryDirectory() as d:
        data = str(Path(d) / "prompts.json")
        rl = Worker("rlpost", [sys.executable, me, "--worker", "rlpost", "--steps", str(args.steps),
                               "--rlpost-precision", args.rlpost_precision, "--data", data], env)
        if not cache.exists():
            sys.exit(f"error: {cache} missing (the rlpost worker should have converted it)")
        trl = Worker("trl", [args.trl_python, me, "--worker", "trl", "--steps", str(args.steps), "--data", data,
                             "--model-dir", str(cache)], {**env, "PYTHONPATH": ""})
        print(f"rlpost: precision {rl.info['precision']}, threads {rl.info['threads']}; "
              f"TRL: fp32, gradient checkpointing {trl.info.get('gradient_checkpointing')}, threads {trl.info['threads']}")
        try:
            for s in range(args.steps):
                for w in ((rl, trl) if s % 2 == 0 else (trl, rl)):
                    r = w.step()
                    print(f"step {s + 1} {w.name:6s} {r['step_s']:.1f} s (rollout {r['rollout_s']:.1f})", flush=True)
        finally:
            rl.close()
            trl.close()
    tail = slice(1, None) if args.steps > 1 else slice(None)

    def med(w, k):
        return statistics.median(r[k] for r in w.rows[tail])

    print("\n| runner | s/step | rollout s | update s | peak RSS |")
    print("| --- | --- | --- | --- | --- |")
    for w, label in ((trl, "TRL GRPOTrainer, fp32 (its defaults)"), (rl, f"rlpost, precision={args.rlpost_precision} ({rl.info['precision']})")):
        print(f"| {label} | {med(w, 'step_s'):.1f} | {med(w, 'rollout_s'):.1f} | {med(w, 'update_s'):.1f} | "
              f"{max(r['rss_mb'] for r in w.rows) / 1024:.2f} GB |")
    print(f"\nmedians of steps 2-{args.steps}; TRL / rlpost: step {med(trl, 'step_s') / med(rl, 'step_s'):.2f}x, "
          f"rollout {med(trl, 'rollout_s') / med(rl, 'rollout_s'):.2f}x, update {med(trl, 'update_s') / med(rl, 'update_s'):.2f}x, "
          f"peak RSS rlpost/TRL {max(r['rss_mb'] for r in rl.rows) / max(r['rss_mb'] for r in trl.rows):.2f}")


if __name__ == "__main__":
    main()
