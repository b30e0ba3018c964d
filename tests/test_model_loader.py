"""The policy tokenizer is parsed once per process and directory (rlpost.models.loader.load_tokenizer)."""

from __future__ import annotations

import os
import shutil

from omegaconf import OmegaConf


def _hf_dir(tmp_path):
    """A local model directory holding the default model's tokenizer files only."""
    from rlpost.config.compose import compose_config
    from rlpost.models.loader import resolve_model_dir

    src = resolve_model_dir(compose_config(["model=tiny"]).model)
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), d / name)
    return d, OmegaConf.create({"source": "hf", "path": str(d)})


def test_each_call_gets_its_own_copy_of_one_parse_and_a_changed_file_is_parsed_again(tmp_path):
    from rlpost.models.loader import load_tokenizer

    d, m = _hf_dir(tmp_path)
    a, b = load_tokenizer(m), load_tokenizer(m)
    assert a is not b and a._tokenizer is b._tokenizer  # one parse, two callers
    assert (a.padding_side, a.pad_token) == ("left", b.pad_token) and a.pad_token is not None
    b.padding_side = "right"  # a caller's setting stays with its copy
    assert a.padding_side == "left" and load_tokenizer(m).padding_side == "left"
    assert a(["a", "a b c"], padding=True)["input_ids"][0][-1] == b(["a", "a b c"], padding=True)["input_ids"][0][0]
    ids = a("Calculate 27 + 45.")["input_ids"]
    # the directory changes (a run's final export written again): the next load parses the new files
    cfg = d / "tokenizer_config.json"
    cfg.write_text(cfg.read_text() + "\n")
    c = load_tokenizer(m)
    assert c._tokenizer is not a._tokenizer and c("Calculate 27 + 45.")["input_ids"] == ids
