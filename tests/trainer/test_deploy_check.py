"""The decisions around a deploy: the canary verdict, the off-policy estimate, and the whole
deploy check on a tiny policy against empty and poisoned batches."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tabloop.core.policy.actions import Completion
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.model import GPT
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.canary import ArmStats, CanaryConfig, arm_stats, canary_verdict
from trainer.deploy_check import CheckConfig, check, heldout_sample, kept_drop, snis
from trainer.update import Batch, UpdateConfig, UpdateInputs, make_optimizer, update

CFG = CanaryConfig(
    min_rollouts=100,
    timeout_s=600,
    min_shown=20,
    reward_tolerance=0.02,
    accept_tolerance=0.05,
    z=0.0,
)  # z 0: roll back on any drop past tolerance
LIVE = ArmStats(n=1000, shown=200, accepted=100, mean_reward=0.05)


@pytest.mark.parametrize(
    ("name", "canary", "age_s", "verdict"),
    [
        ("too few rollouts yet", ArmStats(50, 20, 10, 0.2), 10, "wait"),
        ("enough rollouts, too few shown", ArmStats(150, 5, 5, 0.1), 10, "wait"),
        ("timed out with too little data", ArmStats(50, 5, 5, 0.1), 601, "rollback"),
        ("collapse: shows nothing, times out", ArmStats(500, 0, 0, 0.0), 601, "rollback"),
        ("holds reward and accept rate", ArmStats(150, 30, 15, 0.05), 10, "promote"),
        ("within the reward tolerance", ArmStats(150, 30, 15, 0.035), 10, "promote"),
        ("reward drops past tolerance", ArmStats(150, 30, 15, 0.02), 10, "rollback"),
        ("accept rate drops past tolerance", ArmStats(150, 40, 15, 0.06), 10, "rollback"),
        ("better on both", ArmStats(150, 25, 20, 0.15), 10, "promote"),
    ],
)
def test_canary_verdict(name: str, canary: ArmStats, age_s: float, verdict: str) -> None:
    got, why = canary_verdict(canary, LIVE, age_s, CFG)
    assert got == verdict, f"{name}: {why}"
    assert why


def test_arm_stats_without_capping_are_the_plain_counts() -> None:
    users = ["a", "b", "c", "d"] * 5
    outcomes = ["accepted", "rejected", "abstained", "accepted"] * 5
    values = [0.5, -0.25, 0.0, 0.5] * 5
    arm = arm_stats(values, outcomes, users, [None] * 20, max_share=0.25)
    assert (arm.n, arm.shown, arm.accepted) == (20, 15, 10)
    assert arm.mean_reward == pytest.approx(0.1875)
    assert arm.reward_var == pytest.approx(sum((v - 0.1875) ** 2 for v in values) / 20)


def test_one_person_rejecting_everything_cannot_carry_the_canary() -> None:
    """Ten honest people accept 60% of what they are shown; an adversary sends as many rejects
    as all of them together. Unweighted, the canary's accept rate halves and the verdict is a
    rollback; under the caps the adversary holds a quarter of the weight."""
    honest = [(f"h{i}", "accepted" if j < 3 else "rejected") for i in range(10) for j in range(5)]
    adversary = [("adv", "rejected")] * 50
    rows = honest + adversary
    users = [u for u, _ in rows]
    outcomes = [o for _, o in rows]
    values = [0.5 if o == "accepted" else -0.25 for o in outcomes]
    keys = ["k-honest"] * len(honest) + ["k-adv"] * len(adversary)
    plain = arm_stats(values, outcomes, users, keys, max_share=1.0)
    capped = arm_stats(values, outcomes, users, keys, max_share=0.25)
    assert plain.accept_rate == pytest.approx(0.3)
    # the adversary's person and key each hold 25%: 0.75 * 0.6 = 0.45
    assert capped.accept_rate == pytest.approx(0.45)
    assert capped.n < plain.n and capped.shown < plain.shown  # fewer effective rows
    live = ArmStats(n=100, shown=100, accepted=60, mean_reward=0.2, reward_var=0.14)
    cfg = CanaryConfig(
        min_rollouts=50,
        timeout_s=600,
        min_shown=20,
        reward_tolerance=0.15,
        accept_tolerance=0.2,
        z=0.0,
    )
    assert canary_verdict(plain, live, 10, cfg)[0] == "rollback"
    assert canary_verdict(capped, live, 10, cfg)[0] == "promote"


def test_arm_stats_of_nothing() -> None:
    arm = arm_stats([], [], [], [], max_share=0.25)
    assert (arm.n, arm.shown, arm.accept_rate) == (0, 0, 0.0)


SIG = CanaryConfig(
    min_rollouts=60, timeout_s=150, min_shown=20, reward_tolerance=0.0, accept_tolerance=0.0, z=1.64
)
# the sim profile's scale: a few hundred live rollouts, per-rollout reward s.d. ~0.15
LIVE_SIM = ArmStats(n=400, shown=70, accepted=38, mean_reward=0.005, reward_var=0.0225)


@pytest.mark.parametrize(
    ("name", "canary", "verdict"),
    [
        ("a small drop on 25 shown is noise", ArmStats(120, 25, 12, -0.01, 0.0225), "promote"),
        ("a gain", ArmStats(120, 25, 16, 0.02, 0.0225), "promote"),
        ("reward drops by 3 s.e.", ArmStats(120, 25, 13, -0.045, 0.0225), "rollback"),
        ("accept rate drops by 3 s.e.", ArmStats(120, 30, 5, 0.0, 0.0225), "rollback"),
        ("collapse", ArmStats(120, 0, 0, 0.0, 0.0), "wait"),
    ],
)
def test_canary_verdict_rolls_back_on_significant_drops_only(
    name: str, canary: ArmStats, verdict: str
) -> None:
    got, why = canary_verdict(canary, LIVE_SIM, 10, SIG)
    assert got == verdict, f"{name}: {why}"
    # the same small drop, judged on any drop (z 0), is a rollback: the test decides it
    if name.startswith("a small drop"):
        assert canary_verdict(canary, LIVE_SIM, 10, replace(SIG, z=0.0))[0] == "rollback"


def test_no_accept_in_a_small_canary_is_not_a_significant_drop() -> None:
    """At the telemetry people's few percent, 0 of 25 shown accepted against live's 3 of 25 is
    what an equally good canary often shows (P(0 of 25 | 12%) = 4%). The plain two-proportion
    variance is 0 at a rate of 0, which made it a drop of 1.85 standard errors; Agresti-Caffo's
    (one accept and one not added to each arm) puts it at 1.43. A drop on 100 shown a side is
    still caught."""
    live = ArmStats(120, 25, 3, 0.0, 0.0225)
    got, why = canary_verdict(ArmStats(120, 25, 0, 0.0, 0.0225), live, 10, SIG)
    assert got == "promote", why
    got, why = canary_verdict(
        ArmStats(480, 100, 0, 0.0, 0.0225), ArmStats(480, 100, 12, 0.0, 0.0225), 10, SIG
    )
    assert got == "rollback" and why.startswith("accept rate 0.00 < live 0.12"), why


def test_a_canary_that_wins_reward_by_silence_is_rolled_back() -> None:
    """Fewer shown, each one accepted more often: a higher mean reward and accept rate, but
    people keep a third of the characters per request they kept from live."""
    live = replace(LIVE_SIM, mean_kept=3.0, kept_var=40.0)
    silent = ArmStats(400, 20, 15, 0.02, 0.0225, mean_kept=1.0, kept_var=12.0)
    got, why = canary_verdict(silent, live, 10, SIG)
    assert got == "rollback" and why.startswith("kept chars/request"), why
    # the same arm keeping as much as live is promoted
    assert canary_verdict(replace(silent, mean_kept=3.0), live, 10, SIG)[0] == "promote"


def test_arm_stats_weigh_kept_characters_like_rewards() -> None:
    arm = arm_stats(
        [0.5, -0.25, 0.0, 0.5],
        ["accepted", "rejected", "abstained", "accepted"],
        ["a", "b", "c", "d"],
        [None] * 4,
        max_share=1.0,
        kept=[8.0, 0.0, 0.0, 4.0],
    )
    assert arm.mean_kept == pytest.approx(3.0)
    assert arm.kept_var == pytest.approx((25 + 9 + 9 + 1) / 4)


def test_kept_drop_on_policy_is_no_drop() -> None:
    """The candidate is the live policy: the same mean, a difference of exactly 0."""
    kept = torch.tensor([0.0, 12.0, 3.0, 0.0, 30.0])
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5])
    live, est, se = kept_drop(logp, logp, kept, clip=5.0)
    assert live == pytest.approx(9.0) and est == pytest.approx(9.0) and se == pytest.approx(0.0)


def test_kept_drop_of_a_silent_candidate() -> None:
    """The candidate gives the shown rollouts (which kept characters) a tenth of their logged
    probability and the abstentions twice theirs: its estimate falls well below live's, by more
    than the difference's standard error."""
    kept = torch.tensor([10.0, 0.0] * 20)
    behaviour = torch.zeros(40)
    new = torch.tensor([math.log(0.1), math.log(2.0)] * 20)
    live, est, se = kept_drop(new, behaviour, kept, clip=5.0)
    assert live == pytest.approx(5.0)
    assert est == pytest.approx(10 * 0.1 / (0.1 + 2.0))
    assert 0 < se < live - est


def test_snis_on_policy_is_the_mean_and_ess_is_n() -> None:
    r = torch.tensor([1.0, 0.0, -0.25, 0.75])
    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    est, ess = snis(lp, lp, r, clip=5.0)
    assert est == pytest.approx(float(r.mean())) and ess == pytest.approx(4.0)


def test_snis_weights_toward_what_the_new_policy_prefers_and_clips() -> None:
    r = torch.tensor([1.0, 0.0])
    behaviour = torch.tensor([math.log(0.5), math.log(0.5)])
    new = torch.tensor([math.log(0.9), math.log(0.1)])
    est, ess = snis(new, behaviour, r, clip=5.0)
    assert est == pytest.approx(0.9) and 1.0 < ess < 2.0
    huge = torch.tensor([math.log(0.5) + 50, math.log(0.5)])
    est, _ = snis(huge, behaviour, r, clip=5.0)
    assert est == pytest.approx(5.0 / 6.0)  # weight clipped at 5 against 1


def test_snis_empty() -> None:
    est, ess = snis(torch.empty(0), torch.empty(0), torch.empty(0), clip=5.0)
    assert math.isnan(est) and ess == 0.0


# --- the whole check on a real (tiny) policy ---------------------------------------------
GATE = CheckConfig()
BASE = Path(__file__).resolve().parents[2] / "tabloop" / "core" / "policy" / "base"
PROMPT = "import json\n\n\ndef load(path):\n    with open(path) as f:\n        return json."


def _logged(model: GPT, tokenizer: CodeTokenizer, n: int) -> list[Completion]:
    """n rollouts of `model` at p(show) = 1/2 (its gate's bias 0, hidden weights 0)."""
    with torch.no_grad():
        model.gate.features.weight.zero_()
        model.gate.features.bias.zero_()
    gen = torch.Generator().manual_seed(0)
    return [
        complete(model, tokenizer, PROMPT, "", 6, 0.8, 0.95, gen, stop_logprob=None)
        for _ in range(n)
    ]


def _heldout(tokenizer: CodeTokenizer, small_code: list[str]) -> torch.Tensor:
    return heldout_sample(tokenizer, "\n".join(small_code), rows=8, length=48)


def test_an_empty_batch_cannot_pass_the_gate(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """No logged rollouts to estimate the candidate on: no evidence, no deploy."""
    result = check(
        copy.deepcopy(tiny_model),
        tiny_model,
        tiny_tokenizer,
        _heldout(tiny_tokenizer, small_code),
        [],
        torch.empty(0),
        torch.empty(0),
        GATE,
    )
    assert not result.passed
    assert "effective sample size" in result.reason


def test_poisoned_settled_text_cannot_pass_the_gate() -> None:
    """The shipped base policy, and a batch whose settled texts are garbage pushed hard: the
    language model forgets code, and the held-out check stops it, whatever its reward estimate
    says."""
    from tabloop.core.corpus import read_corpus

    base, tokenizer, _ = load_checkpoint(BASE)
    comps = _logged(base, tokenizer, 16)
    rewards = [0.5 if c.shown else 0.0 for c in comps]
    poison = ["}}}{{{ ~~~ ^^^ ???? ;;;; @@@@"] * len(comps)
    candidate = copy.deepcopy(base)
    candidate.requires_grad_(True)
    cfg = UpdateConfig(learning_rate=1e-3, kl_coef=0.0, settled_epochs=5, minibatch_size=4)
    update(
        UpdateInputs(
            candidate,
            base,
            tokenizer,
            Batch.of(comps, rewards, poison),
            make_optimizer(candidate, cfg),
            cfg,
        )
    )
    heldout = heldout_sample(tokenizer, read_corpus("train"), rows=8, length=64)
    result = check(
        candidate,
        base,
        tokenizer,
        heldout,
        comps,
        torch.tensor([c.logprob_total for c in comps]),
        torch.tensor(rewards),
        replace(GATE, max_reward_drop=10.0),
    )
    assert not result.passed
    assert result.reason.startswith("held-out loss")


def test_small_steps_that_add_up_to_forgetting_fail_against_the_base(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """Each candidate within the bound against its live parent, but far from the base: the
    base bound stops the drift that a live-only check would let through step by step."""
    heldout = _heldout(tiny_tokenizer, small_code)
    drifted = copy.deepcopy(tiny_model)
    with torch.no_grad():
        drifted.wte.weight.add_(0.2 * torch.randn_like(drifted.wte.weight))
    comps = _logged(tiny_model, tiny_tokenizer, 8)
    logp = torch.tensor([c.logprob_total for c in comps])
    rewards = torch.zeros(len(comps))
    lenient = replace(
        GATE, max_heldout_regression=0.0, max_reward_drop=10.0, min_ess=0.0, min_ess_fraction=0.0
    )
    # the drifted model as its own live parent passes; against the base it does not
    assert check(
        drifted, drifted, tiny_tokenizer, heldout, comps, logp, rewards, lenient, base=drifted
    ).passed
    result = check(
        drifted,
        drifted,
        tiny_tokenizer,
        heldout,
        comps,
        logp,
        rewards,
        replace(lenient, max_heldout_regression_base=0.0),
        base=tiny_model,
    )
    assert not result.passed
    assert "vs base" in result.reason


def test_poisoned_rewards_cannot_pass_the_gate(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """A candidate that learned to show everything, judged on logged rollouts where showing was
    punished: its estimated reward falls below live's and it is not deployed."""
    comps = _logged(tiny_model, tiny_tokenizer, 40)
    assert any(c.shown for c in comps) and not all(c.shown for c in comps)
    rewards = torch.tensor([-0.25 if c.shown else 0.0 for c in comps])
    candidate = copy.deepcopy(tiny_model)
    with torch.no_grad():
        candidate.gate.features.bias.fill_(5.0)  # shows nearly everything
    result = check(
        candidate,
        tiny_model,
        tiny_tokenizer,
        _heldout(tiny_tokenizer, small_code),
        comps,
        torch.tensor([c.logprob_total for c in comps]),
        rewards,
        replace(GATE, min_ess_fraction=0.0),
    )
    assert not result.passed
    assert result.reason.startswith("estimated reward")


def test_a_candidate_that_keeps_fewer_characters_is_refused(
    tiny_model: GPT, tiny_tokenizer: CodeTokenizer, small_code: list[str]
) -> None:
    """Logged rollouts where showing lost reward on the whole (short suggestions, many
    rejects) yet the accepted ones kept characters: a candidate that learned to stay silent
    estimates a higher reward than live, and is refused on the kept characters it gives up."""
    comps = _logged(tiny_model, tiny_tokenizer, 40)
    shown = [c.shown for c in comps]
    assert any(shown) and not all(shown)
    rewards = torch.tensor([-0.05 if s else 0.0 for s in shown])
    kept = torch.tensor([4.0 if s else 0.0 for s in shown])
    silent = copy.deepcopy(tiny_model)
    with torch.no_grad():
        silent.gate.features.bias.fill_(-5.0)  # abstains nearly always
    logp = torch.tensor([c.logprob_total for c in comps])
    gate = replace(GATE, min_ess_fraction=0.0)
    heldout = _heldout(tiny_tokenizer, small_code)
    args = (tiny_tokenizer, heldout, comps, logp, rewards, gate)
    result = check(silent, tiny_model, *args, kept=kept)
    assert result.reward_candidate_est > result.reward_live  # the reward alone would pass it
    assert not result.passed
    assert result.reason.startswith("estimated kept chars/request"), result.reason
    assert result.kept_candidate_est < result.kept_live
    assert result.to_dict()["kept_se"] > 0
    assert check(silent, tiny_model, *args).passed  # without the kept characters, it passes


def test_snis_with_vanishing_weights_has_no_evidence() -> None:
    """Tiny weights whose squares underflow float32 are still weights (equal ones: ESS n); ones
    that underflow altogether leave no evidence: no estimate, ESS 0, never a division by 0."""
    est, ess = snis(torch.full((4,), -60.0), torch.zeros(4), torch.ones(4), clip=5.0)
    assert est == pytest.approx(1.0) and ess == pytest.approx(4.0)
    est, ess = snis(torch.full((4,), -2000.0), torch.zeros(4), torch.ones(4), clip=5.0)
    assert math.isnan(est) and ess == 0.0
