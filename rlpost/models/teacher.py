"""A frozen teacher model for distillation presets (``model.teacher=``).

``model.teacher`` names a model config (``tiny``, ``smollm2-135m``: a file of
``conf/model/``) or a local Hugging Face directory. :func:`load_teacher` loads it
once, frozen (no gradients, eval mode, no optimizer state), in the trainer's
precision; :class:`Teacher` owns its parameters and is the only code that runs
them. The runner's ``teacher_logprobs`` stage (after ``ref_logprobs``) calls
:meth:`Teacher.score`, which writes the teacher's per-token log-probs of the
sampled responses and, for losses that need it (tag ``teacher_topk``), the ids
and log-probs of the teacher's top-K tokens at every response position.

:func:`support_logprobs` is the shared log-prob kernel of both sides: one
backbone pass, the LM head run only on real response tokens in chunks (as
:func:`rlpost.models.logprobs.response_logprobs`), returning the sampled token's
log-prob and, from the same logits, either the top-K of the distribution
(teacher) or the log-probs at given token ids (student, with gradient).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from rlpost.config.paths import conf_dir, group_choices
from rlpost.config.schema import ModelConfig
from rlpost.core.errors import ConfigError
from rlpost.models.loader import load_model, load_tokenizer
from rlpost.models.logprobs import TRUNCATED_LOGPROB, packed_response_states


# ----------------------------------------------------------------- config
def teacher_model_config(spec: str, setting: str = "model.teacher") -> Any:
    """The model config named by ``model.teacher``: a ``conf/model/NAME.yaml`` preset or a local HF directory.

    Returns an OmegaConf node with the :class:`rlpost.config.schema.ModelConfig`
    fields. A preset's own ``teacher`` is ignored (no teacher of a teacher).
    ``setting`` is the option named in errors (another frozen model, such as
    ``sampler.params.explorer_model``, is resolved the same way).

    Raises:
        ConfigError: ``spec`` is neither a preset name nor an existing directory.
    """
    from omegaconf import OmegaConf

    base = OmegaConf.structured(ModelConfig)
    preset = conf_dir() / "model" / f"{spec}.yaml"
    if preset.exists():
        node = OmegaConf.load(preset)
        node = {k: v for k, v in OmegaConf.to_container(node).items() if k not in ("defaults", "teacher")}
        return OmegaConf.merge(base, node)
    if Path(str(spec)).expanduser().is_dir():
        return OmegaConf.merge(base, {"name": Path(str(spec)).name, "source": "hf", "path": str(spec)})
    raise ConfigError(f"{setting}={spec!r} is neither a model preset ({', '.join(group_choices('model'))}) nor a "
                      f"local model directory. Fix: {setting}=<preset name> or {setting}=/path/to/hf_dir.")


def check_tokenizers(student_tok: Any, teacher_tok: Any, teacher_name: str = "teacher",
                     setting: str = "model.teacher") -> None:
    """Teacher and student must share one vocabulary: token ids index both models' distributions.

    ``setting`` is the option named in the error (``sampler.params.explorer_model`` for S2L-PO's explorer).

    Raises:
        ConfigError: the vocabularies differ (size, or any token's id).
    """
    sv, tv = student_tok.get_vocab(), teacher_tok.get_vocab()
    if sv != tv:
        diff = len(set(sv.items()) ^ set(tv.items()))
        raise ConfigError(f"{setting}={teacher_name}: its tokenizer differs from the student's ({len(tv)} vs "
                          f"{len(sv)} tokens, {diff} (token, id) pairs differ); token ids must index both models' "
                          f"distributions (per-token distillation, importance ratios). Fix: a model of the "
                          f"student's family (same tokenizer).")


# ----------------------------------------------------------------- kernel
def _chunk_support(head, h, targets, inv_temp, want_entropy: bool, top_k: int, top_p: float,
                   support: Optional[torch.Tensor], k_top: int):
    """Per chunk: sampled log-prob ``[n]``, entropy ``[n]``, and ``[n, K]`` support log-probs (or ids).

    The sampled log-prob and entropy follow :func:`rlpost.models.logprobs._chunk_logprobs`
    (the sampler's top-k/top-p truncation); the support log-probs are those of the
    untruncated temperature-scaled distribution, normalised over the whole vocabulary.
    """

    logits = head(h).float()
    if inv_temp is not None:
        logits = logits * inv_temp[..., None]
    full_logz = torch.logsumexp(logits, dim=-1)
    if support is not None:
        sup = logits.gather(-1, support) - full_logz[..., None]
        sup_ids = support
    elif k_top > 0:
        vals, sup_ids = logits.detach().topk(k_top, dim=-1)
        sup = vals - full_logz[..., None]
    else:
        sup, sup_ids = logits.new_zeros(logits.shape[0], 0), support
    truncated = bool(top_k) or top_p < 1.0
    if truncated:
        from rlpost.models.sampling import apply_top_k_top_p

        logits = apply_top_k_top_p(logits, top_k, top_p)
        logz = torch.logsumexp(logits, dim=-1)
    else:
        logz = full_logz
    lp = logits.gather(-1, targets[..., None]).squeeze(-1) - logz
    if truncated:
        lp = lp.clamp(min=TRUNCATED_LOGPROB)
    if not want_entropy:
        ent = torch.zeros_like(lp)
    else:
        with torch.no_grad():
            p = torch.softmax(logits, dim=-1)
            plogit = torch.where(p > 0, p * logits, torch.zeros_like(logits)) if truncated else p * logits
            ent = logz - plogit.sum(-1)
    if sup_ids is None:
        sup_ids = torch.zeros(sup.shape, dtype=torch.long, device=sup.device)
    return lp, ent, sup, sup_ids


def support_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attn: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    support_ids: Optional[torch.Tensor] = None,
    k_top: int = 0,
    chunk_size: int = 64,
    with_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Sampled-token log-probs plus log-probs on a per-position token support, from one forward pass.

    Args:
        model: a transformers causal LM.
        prompt_ids, prompt_mask: ``[B, P]`` left-padded.
        response_ids, response_attn: ``[B, R]`` right-padded ids; 1 on real tokens.
        temperature: scalar or ``[B, R]``; logits are divided by it (0 entries = 1).
        support_ids: ``[B, R', K]`` long token ids (``R' >= R``; only the first R
            columns are read) whose log-probs to return, with gradient (the student
            side of a top-K distillation loss); or None.
        k_top: with ``support_ids`` None and ``k_top > 0``, return the ``k_top``
            highest-probability tokens of each position (the teacher side).
        chunk_size, with_entropy: as :func:`rlpost.models.logprobs.response_logprobs`.
        top_k, top_p: the sampler's truncation for the sampled-token log-prob and
            the entropy (the support log-probs are always untruncated).
    Returns:
        ``(logprobs [B, R], entropy [B, R] or None, support_logprobs [B, R, K],
        support_ids [B, R, K])``, float32 log-probs in nats normalised over the
        whole vocabulary; 0 (ids 0) on padding positions. ``K`` is 0 when neither
        ``support_ids`` nor ``k_top`` is given.
    """

    head, flat_idx, hs, tgt, inv_temp = packed_response_states(
        model, prompt_ids, prompt_mask, response_ids, response_attn, temperature)
    B, R = response_ids.shape
    sup_in = None
    K = int(k_top)
    if support_ids is not None:
        K = support_ids.shape[-1]
        sup_in = support_ids[:, :R].to(hs.device).reshape(B * R, K).index_select(0, flat_idx)
    rows = max(1, chunk_size * B)
    N = hs.shape[0]
    use_ckpt = torch.is_grad_enabled() and N > rows
    parts: list = [[], [], [], []]
    for s in range(0, N, rows):
        e = min(N, s + rows)
        args = (head, hs[s:e], tgt[s:e], None if inv_temp is None else inv_temp[s:e], with_entropy, top_k, top_p,
                None if sup_in is None else sup_in[s:e], K)
        out = checkpoint(_chunk_support, *args, use_reentrant=False) if use_ckpt else _chunk_support(*args)
        for lst, x in zip(parts, out):
            lst.append(x)

    def unpack(xs, width: int = 0, dtype=torch.float32):
        if xs:
            flat = torch.cat(xs)
        else:  # no real token: an empty view of ``hs`` keeps the result on the graph (zero gradients)
            flat = hs.float().sum(-1)
            flat = flat[:, None].expand(0, width) if width else flat
            flat = flat.to(dtype)
        shape = (B * R, width) if width else (B * R,)
        out = torch.zeros(shape, dtype=dtype, device=hs.device).index_copy(0, flat_idx, flat.to(dtype))
        return out.view(B, R, width) if width else out.view(B, R)

    lp = unpack(parts[0])
    ent = unpack(parts[1]) if with_entropy else None
    sup = unpack(parts[2], K) if K else torch.zeros(B, R, 0, device=hs.device)
    sids = unpack(parts[3], K, torch.long) if K else torch.zeros(B, R, 0, dtype=torch.long, device=hs.device)
    return lp, ent, sup, sids


# ----------------------------------------------------------------- teacher
class Teacher:
    """The frozen teacher: owns its module (no grad, eval mode, never in an optimizer).

    Args:
        module: the teacher causal LM (already on the trainer's device, in its dtype).
        name: the ``model.teacher`` spec, for messages.
    """

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module = module.eval().requires_grad_(False)
        self.name = name

    @torch.no_grad()
    def score(self, batch: Any, trainer: Any, top_k: int = 0) -> Dict[str, torch.Tensor]:
        """Teacher log-probs of the batch's responses, micro-batched like the trainer's passes.

        The teacher is scored at the rollout temperature (the distribution both
        models are compared under, as the student's log-probs are) and without the
        sampler's top-k/top-p truncation: truncating the teacher would put
        ``-inf`` on tokens the student may still choose. (Our choice; the authors'
        verl code scores teacher and student with the same temperature.)

        Args:
            batch: :class:`rlpost.core.batch.RolloutBatch`.
            trainer: the run's trainer (its micro-batch split and its
                :meth:`~rlpost.trainer.torch_engine.TorchTrainer.forward_pass`: autocast,
                device, temperature, log-prob chunk size).
            top_k: K of the top-K support to return (0: none).
        Returns:
            ``{"teacher_logprobs": [B, R]}`` and with ``top_k > 0`` also
            ``"teacher_topk_ids"`` ``[B, R, K]`` long and ``"teacher_topk_logprobs"``
            ``[B, R, K]`` (full-vocabulary log-probs, descending), on CPU, zeros on padding.
        """
        fwd = trainer.forward_pass()
        B, R = len(batch), batch.response_ids.shape[1]
        lps = torch.zeros(B, R)
        ids = torch.zeros(B, R, top_k, dtype=torch.long)
        sups = torch.zeros(B, R, top_k)
        for rows, mb in trainer._split(batch):
            attn = mb.extras.get("response_attn", (mb.response_mask > 0).long())
            with fwd.autocast():
                lp, _, sup, sid = support_logprobs(
                    self.module, mb.prompt_ids.to(fwd.device), mb.prompt_mask.to(fwd.device),
                    mb.response_ids.to(fwd.device), attn.to(fwd.device),
                    temperature=fwd.temperature(mb), k_top=top_k, chunk_size=fwd.chunk_size)
            idx = torch.tensor(rows, dtype=torch.long)
            w = lp.shape[1]
            lps[idx, :w] = lp.float().cpu()
            if top_k:
                ids[idx, :w] = sid.cpu()
                sups[idx, :w] = sup.float().cpu()
        out = {"teacher_logprobs": lps * batch.response_mask}
        if top_k:
            out["teacher_topk_ids"] = ids
            out["teacher_topk_logprobs"] = sups
        return out


def load_teacher(spec: str, student_tokenizer: Any, dtype: torch.dtype, device: Any, seed: int = 0,
                 setting: str = "model.teacher") -> Teacher:
    """Load ``model.teacher`` frozen, in ``dtype`` (the trainer's precision), on ``device``.

    ``setting`` is the option named in errors (S2L-PO's explorer loads through here too).

    ``model.teacher=tiny`` builds the random tiny model from ``seed`` (the run
    seed), so a tiny student and a tiny teacher of one run start identical.
    LoRA settings of the named preset are not applied: the teacher is never trained.

    Raises:
        ConfigError: unknown spec, or a tokenizer that differs from the student's.
        ModelLoadError: the teacher cannot be loaded.
    """
    from omegaconf import OmegaConf

    mcfg = teacher_model_config(spec, setting)
    OmegaConf.update(mcfg, "lora.rank", 0)
    OmegaConf.update(mcfg, "gradient_checkpointing", False)
    check_tokenizers(student_tokenizer, load_tokenizer(mcfg), spec, setting)
    module = load_model(mcfg, dtype, seed=seed).to(device)
    return Teacher(module, spec)


def support_pass(fwd: Any, mb: Any, support_ids: torch.Tensor, with_entropy: bool):
    """The update's forward of micro-batch ``mb`` under ``fwd`` (a :class:`rlpost.methods.base.ForwardPass`):
    ``(sampled log-probs [b, R] with grad, entropy [b, R] or None, log-probs on support_ids [b, R, K])``,
    with the sampler's temperature and truncation (:func:`support_logprobs`)."""
    attn = mb.extras.get("response_attn", (mb.response_mask > 0).long())
    dev = fwd.device
    with fwd.autocast():
        lp, ent, sup, _ = support_logprobs(
            fwd.model, mb.prompt_ids.to(dev), mb.prompt_mask.to(dev), mb.response_ids.to(dev), attn.to(dev),
            temperature=fwd.temperature(mb), support_ids=support_ids, chunk_size=fwd.chunk_size,
            with_entropy=with_entropy, **fwd.truncation)
    return lp, ent, sup


def student_support_pass(fwd: Any, mb: Any, with_entropy: bool, entropy_grad: bool = False):
    """The policy update's forward for a top-K distillation loss: one pass, sampled and support log-probs.

    ``fwd``: the trainer's :class:`rlpost.methods.base.ForwardPass`. Same inputs as its ``logprobs`` (temperature, the sampler's
    truncation for the sampled token); additionally the student's log-probs at
    ``mb.extras['teacher_topk_ids']``, with gradient.

    Returns:
        ``(logprobs [b, R], entropy [b, R] or None, teacher inputs)``: the last a
        dict of :class:`rlpost.algos.losses.PolicyLossInput` fields
        (``teacher_logprobs``, ``support_logprobs``, ``teacher_support_logprobs``),
        cut to the micro-batch's response width.
    Raises:
        ConfigError: an entropy bonus with gradient (``algo.entropy_coef != 0``),
            which this pass does not differentiate.
    """
    if entropy_grad:
        raise ConfigError("algo.entropy_coef != 0 with a top-K distillation loss: the entropy bonus's gradient is not "
                          "computed on this path. Fix: algo.entropy_coef=0.")
    lp, ent, sup = support_pass(fwd, mb, mb.extras["teacher_topk_ids"], with_entropy)
    dev, R = fwd.device, lp.shape[1]
    return lp, ent, {
        "teacher_logprobs": mb.extras["teacher_logprobs"][:, :R].to(dev),
        "support_logprobs": sup.float(),
        "teacher_support_logprobs": mb.extras["teacher_topk_logprobs"][:, :R].to(dev),
    }


# ----------------------------------------------------------------- several teachers, routed by domain
def route_rows(domains: Any, teacher_domains: Any) -> Dict[str, list]:
    """Oracle routing: the rows of each teacher's domain, ``{domain: [row, ...]}`` (domains with no row left out).

    Args:
        domains: the domain label of each row, length ``B``.
        teacher_domains: the domains that have a teacher (``model.teachers`` keys).
    Raises:
        ConfigError: a row whose domain has no teacher (no fallback: each prompt is scored
            only by its own domain's teacher).
    """
    have = set(teacher_domains)
    out: Dict[str, list] = {}
    for i, d in enumerate(domains):
        d = str(d)
        if d not in have:
            raise ConfigError(f"a prompt of domain {d!r} has no teacher: model.teachers covers "
                              f"{sorted(have)}. Fix: model.teachers.{d}=<model preset or HF dir>.")
        out.setdefault(d, []).append(i)
    return out


class RoutedTeacher:
    """Several frozen teachers, one per domain; each row is scored by its prompt's domain's teacher.

    Multi-teacher on-policy distillation with oracle routing (the setting of "Open-MOPD:
    Diagnosing and Fixing Capability Imbalance in Multi-Teacher On-Policy Distillation",
    arXiv:2608.19098): the domain label of the prompt picks one teacher, the others never
    score that row. :meth:`score` has :meth:`Teacher.score`'s contract, so the
    ``teacher_logprobs`` stage and every loss or estimator that reads the teacher work
    unchanged with one teacher or many.

    Args:
        teachers: ``{domain: Teacher}``; one ``Teacher`` object may serve several domains.
        prompt_domains: the domain of each training example, indexed by ``batch.prompt_index``.
    """

    def __init__(self, teachers: Dict[str, "Teacher"], prompt_domains: Any) -> None:
        self.teachers = dict(teachers)
        self.prompt_domains = [str(d) for d in prompt_domains]
        self.name = ",".join(f"{d}={t.name}" for d, t in sorted(self.teachers.items()))

    def row_domains(self, batch: Any) -> list:
        """The domain label of each row of ``batch`` (from its ``prompt_index``)."""
        return [self.prompt_domains[int(i)] for i in batch.prompt_index.tolist()]

    @torch.no_grad()
    def score(self, batch: Any, trainer: Any, top_k: int = 0) -> Dict[str, torch.Tensor]:
        """:meth:`Teacher.score` of each domain's rows by that domain's teacher, put back in row order.

        Returns:
            as :meth:`Teacher.score`: ``teacher_logprobs`` ``[B, R]`` (+ top-K ``[B, R, K]``), on CPU.
        Raises:
            ConfigError: a row whose domain has no teacher (:func:`route_rows`).
        """
        B, R = len(batch), batch.response_ids.shape[1]
        out: Dict[str, torch.Tensor] = {"teacher_logprobs": torch.zeros(B, R)}
        if top_k:
            out["teacher_topk_ids"] = torch.zeros(B, R, top_k, dtype=torch.long)
            out["teacher_topk_logprobs"] = torch.zeros(B, R, top_k)
        for dom, rows in route_rows(self.row_domains(batch), self.teachers).items():
            part = self.teachers[dom].score(batch.select(rows), trainer, top_k=top_k)
            idx = torch.tensor(rows, dtype=torch.long)
            for k, v in part.items():
                out[k][idx] = v
        return out


def load_teachers(specs: Dict[str, str], student_tokenizer: Any, dtype: torch.dtype, device: Any,
                  prompt_domains: Any, seed: int = 0) -> RoutedTeacher:
    """Load ``model.teachers`` (``{domain: spec}``) as a :class:`RoutedTeacher`; a spec named twice loads once.

    Raises:
        ConfigError: as :func:`load_teacher` (setting ``model.teachers.<domain>``); a training
            example whose domain has no teacher.
    """
    loaded: Dict[str, Teacher] = {}
    teachers: Dict[str, Teacher] = {}
    for dom, spec in sorted(specs.items()):
        spec = str(spec)
        if spec not in loaded:
            loaded[spec] = load_teacher(spec, student_tokenizer, dtype, device, seed=seed,
                                        setting=f"model.teachers.{dom}")
        teachers[dom] = loaded[spec]
    route_rows(sorted(set(str(d) for d in prompt_domains)), teachers)  # every training domain has its teacher
    return RoutedTeacher(teachers, prompt_domains)
