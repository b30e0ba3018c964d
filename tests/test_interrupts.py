"""Ctrl-C during an in-process run: the run's handler is gone afterwards and the caller gets the interrupt."""

from __future__ import annotations

import signal

import pytest

from conftest import tiny_overrides


def test_in_process_interrupt_reaches_the_caller_and_the_handler_does_not_outlive_the_run(compose, tmp_path,
                                                                                          monkeypatch):
    # start from Python's own Ctrl-C handler: an earlier test or library in the same pytest process may have
    # left another one (the full CI run of 2c68e4f did), and the last check below needs the default
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_round_trip(compose, tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, found)


def _interrupt_round_trip(compose, tmp_path, monkeypatch):
    from rlpost.run import runner
    from rlpost.core.errors import Interrupted

    before = signal.getsignal(signal.SIGINT)
    cfg = compose(tiny_overrides("steps=3", "checkpoint.every=100"))
    real_learn = runner.Run.learn

    def learn_then_ctrl_c(self, c, *a, **kw):  # Ctrl-C pressed while step 1 learns
        out = real_learn(self, c, *a, **kw)
        if self.step == 1:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(runner.Run, "learn", learn_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as e:  # what pytest itself stops on
        runner.train(cfg, tmp_path / "run")
    assert isinstance(e.value, Interrupted) and e.value.exit_code == 130
    assert "interrupted (SIGINT) after step 1 of 3" in str(e.value)
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "state.pt").exists()
    assert signal.getsignal(signal.SIGINT) is before  # the run's handler is gone ...
    with pytest.raises(KeyboardInterrupt):  # ... so the next Ctrl-C is an ordinary KeyboardInterrupt at once
        signal.raise_signal(signal.SIGINT)

