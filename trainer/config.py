"""The trainer's configuration, and the two profiles as data.

`PROFILES` is the one place that says how `prod` and `sim` differ. They share the method (a
policy-gradient update of the tokens and the show/abstain decision, then a supervised pass on
the text people settled on, mixed with generic code) and differ in scale: batch, minibatch and
canary sizes and the replay lengths, and the reward windows
(tabloop/core/reward_spec.REWARD_SPECS).
One rule differs as well, and is named there rather than implied by the profile: how the gate
learns (`UpdateConfig.gate_fit`: by a fit on every shown verdict so far, or, `False`, by the
policy gradient alone). `TABLOOP_TRAINER_GATE_FIT` chooses it whatever the profile.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from tabloop.core.config import DEFAULT_MAX_SHARE, Settings
from trainer.canary import CanaryConfig
from trainer.deploy_check import CheckConfig
from trainer.update import UpdateConfig


@dataclass
class TrainerConfig:
    group: str = "tabloop-trainer"  # consumer group (embedded: the trainer_state row)
    batch_size: int = 4096  # finalized rollouts needed before a policy-gradient update
    max_batch_factor: int = 4  # an update takes every eligible rollout up to this x batch_size
    gate_fraction: float = 0.2  # share of a batch held back to estimate the candidate's reward
    staleness: int = 3  # train on rollouts of versions seen in the last N deployments
    # the most of a batch's weight one person or one API key may hold (trainer/caps.py)
    max_share: float = DEFAULT_MAX_SHARE
    canary_fraction: float = 0.1  # share of users the candidate gets first
    canary: CanaryConfig = field(default_factory=lambda: CanaryConfig(2000, 3600.0, 500))
    # seconds between two readings of a canary's arms (each reads every reward of both arms)
    canary_poll_s: float = 5.0
    deploy_check: CheckConfig = field(default_factory=CheckConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    heldout_rows: int = 24  # the gate's held-out code sample
    heldout_len: int = 128
    generic_rows: int = 512  # windows of generic code for the settled passes' pretraining mix
    poll_timeout_s: float = 0.5
    heartbeat_s: float = 1.0
    nproc: int = 1  # ranks of a data-parallel update (trainer/distributed.py); 1: in process

    @classmethod
    def for_profile(cls, profile: str) -> TrainerConfig:
        """The profile's configuration (a copy of PROFILES[profile])."""
        return copy.deepcopy(PROFILES[profile])

    @classmethod
    def for_settings(cls, settings: Settings) -> TrainerConfig:
        """The profile's configuration with the TABLOOP_TRAINER_* overrides."""
        cfg = cls.for_profile(settings.profile)
        cfg.group = settings.trainer_group
        cfg.nproc = settings.trainer_nproc
        if settings.trainer_batch_size:
            cfg.batch_size = settings.trainer_batch_size
        if settings.trainer_canary_min_rollouts:
            cfg.canary = replace(cfg.canary, min_rollouts=settings.trainer_canary_min_rollouts)
        if settings.trainer_gate_fit is not None:
            cfg.update = replace(cfg.update, gate_fit=settings.trainer_gate_fit)
        cfg.update = replace(cfg.update, lines_fit=settings.trainer_lines_fit)
        cfg.max_share = settings.trainer_max_share
        return cfg


PROFILES: dict[str, TrainerConfig] = {
    # production: reward horizon 10 min (RewardSpec()), batches of 4096, canaries to a tenth of
    # the users judged on 2000 rollouts (500 shown) within an hour
    "prod": TrainerConfig(
        batch_size=4096,
        canary_fraction=0.1,
        canary=CanaryConfig(min_rollouts=2000, timeout_s=3600.0, min_shown=500),
        update=UpdateConfig(
            minibatch_size=256,
            # the gate learns by the policy gradient on its decisions alone
            gate_fit=False,
            gate_epochs=0,
            settled_epochs=1,
            settled_replay=4096,
        ),
    ),
    # sim: a whole learn-and-redeploy loop in about a minute (reward windows in seconds)
    "sim": TrainerConfig(
        batch_size=160,
        # half the users: twice the canary's evidence per second, and after a promotion half
        # of the next batch is the new live policy's own rollouts
        canary_fraction=0.5,
        # the language model learns from the rewards (policy gradient on the tokens) and from
        # settled text: one pass over the batch's and the 320 newest earlier settled rollouts,
        # mixed with generic code (docs/TRAINER.md); the gate is set by a fit on every shown
        # verdict so far (fit_gate_to_rewards), sharpened 3x once 100 are in, growing as
        # sqrt(verdicts / 100) up to 10x; until then four more passes on the gate alone.
        # 100, not 300: the gate's verdicts exclude the shown copies, and with 8 people 300
        # came after about 9 minutes, so the gate learned only by its clipped passes
        update=UpdateConfig(
            minibatch_size=64,
            gate_epochs=4,
            gate_fit=True,
            gate_fit_sharpness=3.0,
            gate_fit_sharpness_max=10.0,
            gate_fit_min_shown=100,
            settled_epochs=1,
            settled_replay=320,
        ),
        canary_poll_s=1.0,  # a canary lasts seconds here
        canary=CanaryConfig(
            min_rollouts=60,
            timeout_s=150.0,
            min_shown=20,
            # ~20 shown a side: a canary catches a collapse or a large drop, not a small
            # gain; no tolerance on top of the significance test
            reward_tolerance=0.0,
            accept_tolerance=0.0,
        ),
    ),
}
