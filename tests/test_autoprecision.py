"""precision=auto: the choice rule on injected flags and matmul rates, the per-machine cache, config resolution."""

import json

import pytest
import torch

from rlpost.core.autoprecision import MARGIN, cached_measure, choose_precision, resolve_precision


def rates(train32, train16, dec32, dec16):
    return lambda: {"train_fp32": train32, "train_bf16": train16, "decode_fp32": dec32, "decode_bf16": dec16}


def test_cuda_picks_bf16_only_where_supported():
    assert (choose_precision("cuda", cuda_bf16=True).trainer_dtype, choose_precision("cuda", cuda_bf16=True).rollout_dtype) == ("bf16", "bf16")
    c = choose_precision("cuda", cuda_bf16=False)
    assert (c.trainer_dtype, c.rollout_dtype) == ("fp32", "fp32")


def test_cpu_without_bf16_instructions_never_measures():
    def boom():
        raise AssertionError("must not measure without bf16 instructions")

    c = choose_precision("cpu", flags={"avx2", "avx512f", "fma"}, measure=boom)
    assert (c.trainer_dtype, c.rollout_dtype) == ("fp32", "fp32")


def test_cpu_with_bf16_instructions_follows_the_measurement():
    flags = {"avx512f", "avx512_bf16"}
    # Intel Xeon with avx512_bf16, no AMX: bf16 GEMM at half the fp32 rate, decode bandwidth-bound
    # (a faster decode matmul alone does not make bf16 rollouts faster: the engine stays fp32)
    c = choose_precision("cpu", flags=flags, measure=rates(291, 154, 10, 20))
    assert (c.trainer_dtype, c.rollout_dtype) == ("fp32", "fp32")
    # the printed reason says why a faster bf16 decode figure did not pick bf16 rollouts
    assert c.reason.endswith("decode fp32 10 / bf16 20; rollouts use bf16 only when training does")
    assert "only when training" not in choose_precision("cpu", flags=flags, measure=rates(291, 154, 20, 10)).reason
    # AMD EPYC of issue 15: 169 fp32 vs 408 bf16
    c = choose_precision("cpu", flags=flags, measure=rates(169, 408, 10, 20))
    assert (c.trainer_dtype, c.rollout_dtype) == ("bf16", "bf16")
    # AMX: same rule through the amx_bf16 flag
    c = choose_precision("cpu", flags={"amx_bf16"}, measure=rates(100, 900, 10, 9))
    assert (c.trainer_dtype, c.rollout_dtype) == ("bf16", "fp32")


def test_margin_is_strict():
    flags = {"avx512_bf16"}
    at = choose_precision("cpu", flags=flags, measure=rates(100, 100 * MARGIN, 100, 100 * MARGIN))
    above = choose_precision("cpu", flags=flags, measure=rates(100, 100 * MARGIN + 1, 100, 100 * MARGIN + 1))
    assert (at.trainer_dtype, at.rollout_dtype) == ("fp32", "fp32")
    assert (above.trainer_dtype, above.rollout_dtype) == ("bf16", "bf16")
    only_decode = choose_precision("cpu", flags=flags, measure=rates(100, 100, 100, 300))
    assert (only_decode.trainer_dtype, only_decode.rollout_dtype) == ("fp32", "fp32")


def test_cache_measures_once_per_machine(tmp_path, monkeypatch):
    calls = []

    def fake():
        calls.append(1)
        return {"train_fp32": 1.0, "train_bf16": 2.0, "decode_fp32": 3.0, "decode_bf16": 4.0}

    monkeypatch.setattr("rlpost.core.autoprecision.measure_matmul_gflops", fake)
    monkeypatch.setattr("rlpost.core.autoprecision.os.getloadavg", lambda: (0.5, 0.5, 0.5))
    path = tmp_path / "precision_auto.json"
    m = cached_measure({"avx512_bf16"}, path)
    assert m() == fake() and len(calls) == 2  # one measured, one direct call above
    assert m()["decode_bf16"] == 4.0 and len(calls) == 2  # second read comes from the file
    assert list(json.loads(path.read_text()).values())[0]["train_bf16"] == 2.0
    other = cached_measure({"avx512_bf16", "amx_bf16"}, path)  # different machine key
    other()
    assert len(calls) == 3 and len(json.loads(path.read_text())) == 2
    path.write_text("not json")  # a corrupt cache is re-measured, not an error
    assert m()["train_fp32"] == 1.0 and len(calls) == 4


def test_resolve_replaces_auto_and_leaves_concrete_alone(monkeypatch, capsys):
    from rlpost.config.compose import compose_config

    monkeypatch.setattr("rlpost.core.autoprecision.cpu_flags", lambda: {"avx2"})
    monkeypatch.setattr("rlpost.core.autoprecision._PRINTED", False)
    cfg = compose_config(["model=tiny"])
    assert cfg.precision.name == "auto" and cfg.precision.trainer_dtype == "auto"  # the default
    choice = resolve_precision(cfg, torch.device("cpu"))
    assert choice is not None and (cfg.precision.trainer_dtype, cfg.precision.rollout_dtype) == ("fp32", "fp32")
    assert "precision=auto: trainer fp32, rollout fp32" in capsys.readouterr().err
    assert resolve_precision(cfg, torch.device("cpu")) is None  # idempotent
    assert capsys.readouterr().err == ""  # printed once
    fixed = compose_config(["model=tiny", "precision=bf16"])
    assert resolve_precision(fixed, torch.device("cpu")) is None and fixed.precision.trainer_dtype == "bf16"


def test_a_measurement_on_a_busy_machine_is_used_but_not_cached(monkeypatch, tmp_path):
    calls = []

    def fake():
        calls.append(1)
        return {"train_fp32": 30.0, "train_bf16": 26.0, "decode_fp32": 8.0, "decode_bf16": 49.0}

    monkeypatch.setattr("rlpost.core.autoprecision.measure_matmul_gflops", fake)
    monkeypatch.setattr("rlpost.core.autoprecision.os.cpu_count", lambda: 2)
    monkeypatch.setattr("rlpost.core.autoprecision.os.getloadavg", lambda: (7.5, 6.0, 4.0))
    path = tmp_path / "precision_auto.json"
    m = cached_measure({"avx512_bf16"}, path)
    assert m()["train_fp32"] == 30.0 and not path.exists()
    m()
    assert len(calls) == 2  # measured again: nothing was cached
    monkeypatch.setattr("rlpost.core.autoprecision.os.getloadavg", lambda: (1.0, 1.0, 1.0))  # only this process runs
    m()
    m()
    assert len(calls) == 3 and path.exists()
