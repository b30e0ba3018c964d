"""``rollout=vllm``: vLLM's offline engine, colocated with the trainer on the same GPU.

Same interface as ``rollout=hf`` (:class:`rlpost.rollout.base.RolloutEngine`):
token-id prompts in, right-padded response ids, masks and the log-prob of
every sampled token out. vLLM ("Efficient Memory Management for Large Language
Model Serving with PagedAttention", Kwon et al., arXiv:2309.06180) is imported
lazily, so this module is importable on machines without it.

Pieces, each testable without a GPU:

* :func:`build_requests`: our :class:`SamplingParams` -> vLLM ``TokensPrompt``
  dicts and ``vllm.SamplingParams`` keyword arguments (``logprobs=0`` returns the
  sampled token's log-prob; one seed per request derived from the step seed so
  rollouts reproduce).
* :func:`extract_result`: vLLM ``RequestOutput`` objects -> :class:`GenerationResult`.
* :func:`vllm_weight_items`: trainer state -> ``(name, tensor)`` pairs for the
  model's ``load_weights`` (Hugging Face names, which vLLM's loaders map onto
  their fused ``qkv_proj`` / ``gate_up_proj`` themselves; wrapper prefixes,
  rotary buffers and a tied ``lm_head`` dropped).

Weight sync after each update is in memory: ``LLM.apply_model`` (vLLM >= 0.9)
runs ``model.load_weights`` on every worker with the trainer's tensors; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here) the worker is in this process
and the tensors are passed by reference, no disk round trip. Between rollouts
the engine sleeps (``enable_sleep_mode``; ``LLM.sleep(level=1)`` offloads
weights and frees the KV cache, ``wake_up(tags=["weights"])`` before loading new
weights, then ``wake_up(tags=["kv_cache"])``), so the trainer gets the GPU memory
back during the update.

Log-probs: vLLM reports raw-model log-probs by default; we request
``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2) so they are those of the
distribution actually sampled from (after temperature / top-k / top-p), which is
what the trainer recomputes. On older vLLM the engine argument is dropped and
the metrics ``mismatch/*`` show the difference at temperature != 1.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from rlpost.errors import RlpostError
from rlpost.rollout.base import GenerationResult, RolloutEngine, SamplingParams
from rlpost.rollout.hf import left_pad

_SKIP = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")
_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def vllm_weight_items(state: Dict[str, torch.Tensor] | Iterable[Tuple[str, torch.Tensor]],
                      tie_word_embeddings: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Trainer parameters as the ``(name, tensor)`` pairs vLLM's ``model.load_weights`` expects.

    Args:
        state: a state dict or ``named_parameters()`` of a Hugging Face causal LM,
            possibly wrapped (DeepSpeed/DDP ``module.``, ``torch.compile``
            ``_orig_mod.``).
        tie_word_embeddings: drop ``lm_head.weight`` (vLLM ties it to the embedding).
    Yields:
        ``(hf_name, tensor)`` with wrapper prefixes removed (applied repeatedly),
        rotary-embedding buffers skipped, tensors detached. Shapes unchanged.
    """
    items = state.items() if isinstance(state, dict) else state
    for name, t in items:
        changed = True
        while changed:
            changed = False
            for p in _PREFIXES:
                if name.startswith(p):
                    name, changed = name[len(p):], True
        if _SKIP.search(name):
            continue
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        yield name, t.detach()


def build_requests(prompts: Sequence[Sequence[int]], params: SamplingParams) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """vLLM requests for ``prompts`` under ``params``.

    Returns:
        ``(inputs, sampling_kwargs)``: one ``{"prompt_token_ids": [...]}`` dict
        (vLLM's ``TokensPrompt``) and one ``vllm.SamplingParams`` keyword dict per
        prompt. ``max_tokens`` = ``max_new_tokens``; ``temperature`` 0 for greedy;
        ``top_k`` -1 when off (vLLM's "all tokens"); ``logprobs=0`` (the sampled
        token's log-prob only); ``seed = params.seed + i`` for request ``i`` (None
        without a seed), so a group of identical prompts draws different samples
        and a rerun draws the same ones; ``stop`` strings kept in the output
        (``include_stop_str_in_output``) as the hf engine does.
    Raises:
        ValueError: empty ``prompts``, an empty prompt, or a per-token
            ``temperature_hook`` (vLLM samples each request at one temperature;
            use rollout=hf for HAPO's adaptive temperature).
    """
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    if params.temperature_hook is not None:
        raise ValueError("rollout=vllm does not support per-token temperature hooks; use rollout=hf for this algo")
    inputs, kws = [], []
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        inputs.append({"prompt_token_ids": [int(x) for x in p]})
        kws.append({
            "n": 1,
            "max_tokens": int(params.max_new_tokens),
            "temperature": 0.0 if params.greedy else float(params.temperature),
            "top_p": 1.0 if params.greedy else float(params.top_p),
            "top_k": -1 if (params.greedy or not params.top_k) else int(params.top_k),
            "stop": list(params.stop) or None,
            "include_stop_str_in_output": True,
            "logprobs": 0,
            "seed": None if params.seed is None else int(params.seed + i) % (2**63 - 1),
            "detokenize": True,
        })
    return inputs, kws


def _token_logprob(entry: Any, token_id: int) -> float:
    """The log-prob of ``token_id`` in one position's vLLM logprobs dict (``{id: Logprob}`` or ``{id: float}``)."""
    if entry is None or token_id not in entry:
        raise RlpostError(f"vLLM returned no log-prob for sampled token {token_id}; request logprobs=0.")
    v = entry[token_id]
    return float(getattr(v, "logprob", v))


def extract_result(outputs: Sequence[Any], prompts: Sequence[Sequence[int]], pad_id: int,
                   temperature: float, greedy: bool = False) -> GenerationResult:
    """A :class:`GenerationResult` from vLLM ``RequestOutput`` objects (in prompt order).

    Reads ``out.outputs[0].token_ids``, ``.logprobs`` (one dict per generated
    token), ``.text`` and ``.finish_reason`` ("stop" = EOS or stop string,
    "length" = truncated).

    Returns:
        prompt ids/mask ``[B, P]`` (left-padded), response ids ``[B, R]`` (padded
        with ``pad_id``), response mask ``[B, R]`` (1 on generated tokens,
        including EOS), rollout log-probs ``[B, R]`` (0 on padding), per-token
        temperatures ``[B, R]`` (1 for greedy, as the hf engine), finished ``[B]``.
    Raises:
        RlpostError: output count differs from the prompt count, or a log-prob is missing.
    """
    if len(outputs) != len(prompts):
        raise RlpostError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    comps = [o.outputs[0] for o in outputs]
    R = max(1, max(len(c.token_ids) for c in comps))
    B = len(comps)
    ids = torch.full((B, R), pad_id, dtype=torch.long)
    mask = torch.zeros(B, R)
    lps = torch.zeros(B, R)
    temps = torch.zeros(B, R)
    T = 1.0 if greedy else float(temperature)
    for i, c in enumerate(comps):
        toks = list(c.token_ids)
        n = len(toks)
        if n:
            ids[i, :n] = torch.tensor(toks, dtype=torch.long)
            mask[i, :n] = 1.0
            temps[i, :n] = T
            if c.logprobs is None or len(c.logprobs) < n:
                raise RlpostError("vLLM returned fewer log-prob entries than tokens; request logprobs=0.")
            lps[i, :n] = torch.tensor([_token_logprob(c.logprobs[t], toks[t]) for t in range(n)])
    pids, pmask = left_pad([list(p) for p in prompts], pad_id)
    finished = torch.tensor([c.finish_reason == "stop" for c in comps], dtype=torch.bool)
    return GenerationResult(prompt_ids=pids, prompt_mask=pmask, response_ids=ids, response_mask=mask,
                            rollout_logprobs=lps, temperatures=temps, finished=finished,
                            texts=[c.text for c in comps])


def _require_vllm_and_gpu():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise RlpostError(
            f"rollout=vllm needs the vllm package ({e}). Fix: pip install vllm on a machine with an NVIDIA GPU, "
            "or use rollout=hf (CPU or GPU)."
        ) from None
    if not torch.cuda.is_available():
        raise RlpostError("rollout=vllm needs a CUDA GPU and none is visible. Fix: run on a GPU node, or use rollout=hf.")
    return vllm


class VLLMRolloutEngine(RolloutEngine):
    """vLLM offline engine with in-memory weight sync and sleep/wake between rollouts.

    Args:
        cfg: run config (``rollout.*``: ``gpu_memory_utilization``,
            ``enforce_eager``, ``batch_size``; ``precision.rollout_dtype``: fp32 |
            bf16 | fp16 | fp8 (vLLM's ``quantization="fp8"``, dynamic scales);
            ``model.cache_dir``; ``seed``).
        policy: the trainer's policy; its initial weights are written once to
            ``<cache>/vllm_init/<name>`` for vLLM to start from, later updates
            are pushed in memory.
        tokenizer: the policy's tokenizer (pad id, saved beside the weights).
    Raises:
        RlpostError: vLLM not installed or no GPU; an unsupported rollout dtype.
    """

    DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}

    def __init__(self, cfg: Any, policy: torch.nn.Module, tokenizer: Any) -> None:
        rd = cfg.precision.rollout_dtype
        if rd not in self.DTYPES:
            raise RlpostError(f"rollout=vllm supports precision.rollout_dtype in {sorted(self.DTYPES)}, got {rd!r}. "
                              "Fix: use rollout=hf for int8 / fp8_sim / fp4_sim.")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in-process: weights by reference
        vllm = _require_vllm_and_gpu()
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.tie = bool(getattr(policy.config, "tie_word_embeddings", False))
        path = self._init_dir(cfg, policy, tokenizer)
        kw: Dict[str, Any] = dict(
            model=str(path), tokenizer=str(path), dtype=self.DTYPES[rd], seed=int(cfg.seed),
            gpu_memory_utilization=float(cfg.rollout.gpu_memory_utilization), enforce_eager=bool(cfg.rollout.enforce_eager),
            enable_sleep_mode=True, max_num_seqs=int(cfg.rollout.batch_size),
            logprobs_mode="processed_logprobs",
        )
        if rd == "fp8":
            kw["quantization"] = "fp8"
        try:
            self.llm = vllm.LLM(**kw)
        except TypeError:  # vLLM < 0.10.2 has no logprobs_mode
            kw.pop("logprobs_mode")
            self.llm = vllm.LLM(**kw)
        self._SamplingParams = vllm.SamplingParams
        self.sleeping: set = set()  # which of {"weights", "kv_cache"} are offloaded

    @staticmethod
    def _init_dir(cfg: Any, policy: torch.nn.Module, tokenizer: Any) -> Path:
        root = Path(cfg.model.cache_dir or os.environ.get("RLPOST_CACHE", Path.home() / ".cache" / "rlpost"))
        path = root / "vllm_init" / str(cfg.model.name)
        if not (path / "config.json").exists():
            path.mkdir(parents=True, exist_ok=True)
            policy.save_pretrained(path)
            tokenizer.save_pretrained(path)
        return path

    def _wake(self, tag: str) -> None:
        """Wake ``weights`` or ``kv_cache`` if it sleeps (older vLLM without tags wakes both)."""
        if tag not in self.sleeping:
            return
        try:
            self.llm.wake_up(tags=[tag])
            self.sleeping.discard(tag)
        except TypeError:
            self.llm.wake_up()
            self.sleeping.clear()

    def generate(self, prompts: List[List[int]], params: SamplingParams) -> GenerationResult:
        """Sample one response per prompt (see :func:`build_requests` / :func:`extract_result`).

        Wakes the engine if it sleeps and puts it back to sleep afterwards.
        """
        inputs, kws = build_requests(prompts, params)
        self._wake("weights")
        self._wake("kv_cache")
        outs = self.llm.generate(inputs, [self._SamplingParams(**k) for k in kws], use_tqdm=False)
        self.sleep()  # colocated: hand the GPU memory back to the trainer until the next rollout
        return extract_result(outs, prompts, self.pad_id, params.temperature, params.greedy)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Push the trainer's current weights into vLLM in memory (``LLM.apply_model`` -> ``load_weights``)."""
        self._wake("weights")
        items = list(vllm_weight_items(policy.state_dict(), self.tie))
        self.llm.apply_model(lambda model: model.load_weights(iter(items)))

    def sleep(self) -> None:
        """Release the KV cache and offload weights so the trainer can use the GPU memory."""
        if not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def close(self) -> None:
        """Drop the engine (frees GPU memory)."""
        self.llm = None
