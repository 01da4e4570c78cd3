"""The trainer's profiles are data (trainer/config.PROFILES): copies per trainer, and the gate's
learning rule chosen by a setting, not implied by the profile."""

from __future__ import annotations

from pathlib import Path

from tests.service.conftest import make_settings
from trainer.config import PROFILES, TrainerConfig


def test_each_trainer_gets_its_own_copy_of_its_profile() -> None:
    cfg = TrainerConfig.for_profile("sim")
    cfg.update.gate_fit = False
    cfg.batch_size = 1
    assert PROFILES["sim"].update.gate_fit is True and PROFILES["sim"].batch_size == 160


def test_the_gate_rule_is_a_setting_whatever_the_profile(tmp_path: Path) -> None:
    for profile, default in (("prod", False), ("sim", True)):
        assert (
            TrainerConfig.for_settings(make_settings(tmp_path, profile=profile)).update.gate_fit
            is default
        )
        for chosen in (True, False):
            settings = make_settings(tmp_path, profile=profile, trainer_gate_fit=chosen)
            cfg = TrainerConfig.for_settings(settings)
            assert cfg.update.gate_fit is chosen
            # nothing else of the profile moves
            assert cfg.batch_size == PROFILES[profile].batch_size
            assert cfg.update.minibatch_size == PROFILES[profile].update.minibatch_size


def test_the_lines_fit_is_a_setting(tmp_path: Path) -> None:
    for profile in ("prod", "sim"):
        on = TrainerConfig.for_settings(make_settings(tmp_path, profile=profile))
        off = TrainerConfig.for_settings(
            make_settings(tmp_path, profile=profile, trainer_lines_fit=False)
        )
        assert on.update.lines_fit is True and off.update.lines_fit is False
