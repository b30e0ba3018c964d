"""The rollout engine interface shared by the ``hf`` and ``vllm`` engines."""

from __future__ import annotations

from abc import ABC, abstractmethod
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from rlpost.core.batch import pad_cat

# A logits hook sees the raw next-token logits ``[B, V]`` (float32) of the
# unfinished step ``t`` and returns a per-sequence temperature ``[B]`` to sample
# with (HAPO's adaptive temperature is one). Returning None keeps the engine's
# scalar temperature.
TemperatureHook = Callable[[torch.Tensor, int], Optional[torch.Tensor]]

# A decode hook (hf engine only) sees each decode step after its draw:
# ``hook(logp [n, V], tokens [n], rows [n], t) -> (tokens [n], input_embeds [n, H] or None)``, where
# ``logp`` is the log-softmax of the distribution the step sampled from (temperature, top-k/p
# applied), ``rows`` the row of each live sequence in the generate call and ``t`` the response
# position. It returns the tokens to record (their log-probs are read from ``logp``) and, when not
# None, the input embeddings the model is fed at this position instead of the tokens' own
# (N-GRPO's neighbour mixing is one).
DecodeHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], Tuple[torch.Tensor, Optional[torch.Tensor]]]


@dataclass(frozen=True)
class EngineConfig:
    """The parts of a run's config a rollout engine is built from, and nothing else.

    :func:`rlpost.rollout.build_engine`, the vLLM engine, the speculative wrappers and the Ray
    rollout workers read only these, so a key an engine depends on is visible here (a run's other
    sections, e.g. ``algo`` or ``executor``, never reach an engine).

    Attributes:
        rollout: ``cfg.rollout`` (engine, batch size, max lengths, speculative and vLLM settings).
        precision: ``cfg.precision`` (``rollout_dtype``; ``auto`` is resolved in place by the builder).
        model: ``cfg.model`` (name, path, cache_dir, LoRA rank, routing_replay).
        seed: the run's seed (vLLM's engine seed, the MTP head's fit).
        share_weights: an fp32 hf engine may generate with the trainer's own module. False when
            rollouts overlap updates (:func:`rlpost.run.executor.rollouts_overlap_updates`).
    """

    rollout: Any
    precision: Any
    model: Any
    seed: int = 0
    share_weights: bool = True

    @classmethod
    def of(cls, cfg: Any, share_weights: bool = True) -> "EngineConfig":
        """The engine sections of a whole run config ``cfg`` (``rollout``, ``precision``, ``model``, ``seed``)."""
        return cls(cfg.rollout, cfg.precision, cfg.model, int(cfg.get("seed", 0) if hasattr(cfg, "get") else cfg.seed),
                   share_weights)


@dataclass
class SamplingParams:
    """Sampling settings for one generate call.

    Attributes:
        max_new_tokens: response length limit.
        temperature: softmax temperature (> 0) unless ``greedy``.
        top_p: nucleus mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.
        stop: stop strings; generation of a sequence ends once its decoded
            response contains one (the stop string's tokens stay in the response).
        greedy: argmax decoding; rollout log-probs are then those of the
            temperature-1 distribution.
        seed: seed of the sampling generator (reproducible rollouts, and exact
            resume); None draws from torch's global RNG. Row ``i`` of a call
            samples from its own stream, seeded ``seed + row_offset + i``, so a
            row's tokens do not depend on which other rows share the call.
        row_offset: position of this call's first row in a larger call that was
            split across processes (:class:`rlpost.distributed.ShardedEngine`);
            0 otherwise.
        temperature_hook: per-token temperature (see :data:`TemperatureHook`).
        decode_hook: per-step token and input-embedding override (see :data:`DecodeHook`);
            only the hf engine runs one, the others raise ``ValueError``.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: List[str] = field(default_factory=list)
    greedy: bool = False
    seed: Optional[int] = None
    row_offset: int = 0
    temperature_hook: Optional[TemperatureHook] = None
    decode_hook: Optional[DecodeHook] = None


@dataclass
class GenerationResult:
    """Output of :meth:`RolloutEngine.generate` for ``B`` prompts.

    Attributes:
        prompt_ids: ``[B, P]`` left-padded prompt ids; prompt_mask ``[B, P]``.
        response_ids: ``[B, R]`` right-padded sampled ids (pad after the end).
        response_mask: ``[B, R]`` float, 1 on generated tokens up to and
            including EOS.
        rollout_logprobs: ``[B, R]`` log-prob (nats) of each sampled token under
            the distribution it was sampled from; 0 on padding.
        temperatures: ``[B, R]`` temperature each token was sampled at.
        finished: ``[B]`` bool, True if EOS or a stop string ended the sequence
            (False: truncated at max_new_tokens).
        texts: decoded responses (special tokens skipped).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    temperatures: torch.Tensor
    finished: torch.Tensor
    texts: List[str]

    @property
    def num_tokens(self) -> int:
        """Total generated (loss-carrying) tokens."""
        return int(self.response_mask.sum().item())


class RolloutEngine(ABC):
    """Generates responses and reports the log-probs of what it sampled.

    Implementations keep their own copy (or view) of the policy weights and get
    new ones through :meth:`sync_weights` after every update.
    """

    @abstractmethod
    def generate(self, prompts: List[List[int]], params: SamplingParams) -> GenerationResult:
        """Generate one response per prompt (token-id lists, unpadded)."""

    @abstractmethod
    def sync_weights(self, policy: torch.nn.Module) -> None:
        """Load the trainer's current policy weights into the engine."""

    def close(self) -> None:
        """Free engine resources (processes, GPU memory)."""

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """A run of dependent :meth:`generate` calls (the turns of multi-turn episodes).

        Inside it an engine keeps what makes the next call cheap: ``rollout=vllm`` stays awake
        so its prefix cache (the KV of the prompt and the earlier turns) survives from one turn
        to the next instead of being released after every call. The default does nothing.
        """
        yield


def concat_generations(parts: Sequence[GenerationResult], pad_id: int = 0) -> GenerationResult:
    """Stack generation results row-wise, left-padding prompts and right-padding responses.

    Args:
        parts: results with any prompt / response widths.
        pad_id: id written in padding positions (masks are 0 there).

    Raises:
        ValueError: ``parts`` is empty.
    """
    if not parts:
        raise ValueError("nothing to concatenate")
    if len(parts) == 1:
        return parts[0]
    return GenerationResult(
        prompt_ids=pad_cat([p.prompt_ids for p in parts], pad_id, left=True),
        prompt_mask=pad_cat([p.prompt_mask for p in parts], 0, left=True),
        response_ids=pad_cat([p.response_ids for p in parts], pad_id),
        response_mask=pad_cat([p.response_mask for p in parts], 0),
        rollout_logprobs=pad_cat([p.rollout_logprobs for p in parts], 0),
        temperatures=pad_cat([p.temperatures for p in parts], 0),
        finished=torch.cat([p.finished for p in parts]),
        texts=[t for p in parts for t in p.texts],
    )
