"""Telemetry people: simulated editors who take suggestions the way real ones do.

The proxy people (simulator.population) take almost every correct suggestion, however short.
Real people do not. What is encoded here, as numbers only (the data is not shipped):

- Mozannar et al., "Reading Between the Lines: Modeling User Behavior and Costs in AI-Assisted
  Programming" (CHI 2024) and "When to Show a Suggestion? Integrating Human Feedback in
  AI-Assisted Programming" (AAAI 2024), data microsoft/coderec_programming_states (MIT): the
  share of shown suggestions accepted rises steeply with their length, about 2% at <= 5
  characters, 25% at 10-20, 45% at 40-80 and 65% above 160 (ACCEPT_BY_LENGTH); fragments such
  as `)`, `]`, `:` or `= 0` are almost never taken; per person the accept rate ranges from 0.13
  to 0.57, a factor of four (PER_PERSON_ACCEPT).
- Meta's CodeCompose (Murali et al., "AI-assisted Code Authoring at Scale", 2023): multi-line
  suggestions were 16% of those shown but 42% of the accepted characters (MULTI_LINE).
- Copilot's contextual filter (thakkarparth007/copilot-explorer): the previous suggestion
  accepted adds 1.0 to the log-odds of accepting; it also reads the time since the last one,
  the last character of the prefix, whitespace after the cursor, the language and the position
  in the document.

A telemetry person is a proxy person (`PersonParams`: their pace, their eye for close code,
when they switch or leave, how often they press Esc, how rarely they take a wrong suggestion)
plus `TelemetryParams`, drawn after it from the same rng, so the proxy draws are untouched.
Their `accept_correct` and `accept_close` are not used; instead the log-odds of taking a
*correct* suggestion (`judge`, as for the proxy) of `chars` characters on `lines` lines is

    intercept + length_slope * ln(chars / 32) + extra_line_logit * (lines - 1)
      + comment_logit [comment line] + follows_logit [text right of the cursor]
      + momentum_logit [they took the last suggestion shown to them]

and a close one adds `close_logit` (partly taken as for the proxy); a wrong one is taken with
`accept_wrong`. On a def/class line past the keyword every suggestion is rejected or left, as
for the proxy. A suggestion shorter than the person's `min_read_chars`, or one whose service
latency exceeds their `patience_ms`, is not read: they type through it (action "ignore",
nothing sent). After an accept, with probability `edit_later` they rewrite part of it later:
every retention check reports `kept_when_edited` of what matched.

Calibration (tests/simulator/test_telemetry.py recomputes it from seeded draws). The telemetry
rates are over *all* shown suggestions, right or wrong; the curve here is for *correct* ones
(prefixes of the true rest of the line), fitted straight to those rates. We did not divide
them by a share of correct ones: that share per length is not published, and any plausible
share of exactly correct long suggestions (well under 65%) puts the long end above 1. So these
people take correct code about as often as real
people take what they are shown, and take much less of wrong code; a policy's overall accept
rate here is below the telemetry by about its share of wrong suggestions. The fit averages over
the population with momentum at each person's stationary rate, on a reference mix of lengths
(uniform in each ACCEPT_BY_LENGTH bucket, the four buckets weighted equally: our assumption,
the data's length histogram is not shipped); per-person rates are compared at the 5th and 95th
percentile (the data's are its lowest and highest person, of a small study). Fitted:
length_slope 0.8, intercept uniform in (-2.6, 0.4), min_read_chars 4-7, giving 2.0%, 25%, 45%
and 66% by bucket and people from 0.13 to 0.57. With a multi-line suggestion taken as 3 lines
of single-line length (our assumption), the length term alone gives CodeCompose's share (42%),
so extra_line_logit is 0.0 (4 lines would want about -0.4). Context effects, patience and edits
are our assumptions, directions from the sources above.

Two populations for learning tests, as `--population` JSON:
  short_takers (take short correct code, like the proxy):
      {"min_read_chars": 1, "length_slope": 0.0, "intercept": [2.0, 3.5]}
  short_refusers (never take 5 characters or fewer): {"min_read_chars": 6}
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from simulator.population import (
    MIN_DELAY_S,
    Decision,
    PersonParams,
    PopulationConfig,
    Verdict,
    draw_params,
    expected_taken,
    in_reject_family,
    judge,
    line_before_cursor,
    matched_fraction,
    taken_chars,
)

People = Literal["proxy", "telemetry"]
PEOPLE: tuple[People, ...] = ("proxy", "telemetry")

# the published facts the defaults are fitted to (see the module docstring)
ACCEPT_BY_LENGTH: dict[tuple[int, int], float] = {
    (1, 5): 0.02,
    (10, 20): 0.25,
    (40, 80): 0.45,
    (161, 320): 0.65,  # "> 160": up to twice that in the reference mix
}
PER_PERSON_ACCEPT = (0.13, 0.57)  # lowest and highest person's accept rate
MULTI_LINE = (0.16, 0.42)  # multi-line share of shown suggestions, of accepted characters
LENGTH_REF_CHARS = 32  # `intercept` is the log-odds at this length


@dataclass(frozen=True)
class TelemetryParams:
    """One telemetry person's habits on top of their PersonParams (drawn from a
    TelemetryConfig); log-odds terms add up as in the module docstring."""

    intercept: float  # log-odds of taking a correct one-line 32-character suggestion
    length_slope: float  # per unit of ln(characters)
    extra_line_logit: float  # per line after the first
    comment_logit: float  # the line before the cursor is a comment
    follows_logit: float  # text stands right of the cursor on the line
    momentum_logit: float  # they took the last suggestion shown to them
    close_logit: float  # a close suggestion rather than a correct one
    min_read_chars: int  # shorter suggestions are typed through unread
    patience_ms: float  # a suggestion slower than this is typed through unread
    edit_later: float  # P(rewrite part of an accepted suggestion later)
    kept_when_edited: float  # of what matched, the share kept when they do


Range = tuple[float, float]
_INT_FIELDS = ("min_read_chars",)
_PROBABILITY_FIELDS = ("edit_later", "kept_when_edited")
_SIGNED_FIELDS = (
    "intercept",
    "extra_line_logit",
    "comment_logit",
    "follows_logit",
    "momentum_logit",
    "close_logit",
)


@dataclass(frozen=True)
class TelemetryConfig:
    """Ranges (low, high) each telemetry person's parameter is drawn from uniformly (integers
    inclusive); a single value is both ends. Sources: the module docstring."""

    intercept: Range = (-2.6, 0.4)  # fitted: ACCEPT_BY_LENGTH and PER_PERSON_ACCEPT (Mozannar)
    length_slope: Range = (0.8, 0.8)  # fitted: ACCEPT_BY_LENGTH (Mozannar)
    extra_line_logit: Range = (0.0, 0.0)  # fitted: MULTI_LINE (CodeCompose), 3-line assumption
    comment_logit: Range = (-1.0, -1.0)  # assumption: completing a comment is rarely wanted
    follows_logit: Range = (-0.7, -0.7)  # assumption; Copilot's filter reads what follows
    momentum_logit: Range = (1.0, 1.0)  # Copilot's contextual filter: +1.0 after an accept
    close_logit: Range = (-1.5, -1.5)  # assumption: the proxy's close/correct odds ratio
    min_read_chars: Range = (4, 7)  # fitted: <= 5 characters 2%, fragments never (Mozannar)
    patience_ms: Range = (400.0, 1500.0)  # assumption: slower ones arrive after typing on
    edit_later: Range = (0.10, 0.25)  # assumption: accepted code that is rewritten later
    kept_when_edited: Range = (0.3, 0.8)  # assumption: how much of it survives the rewrite

    def __post_init__(self) -> None:
        for f in fields(self):
            low, high = getattr(self, f.name)
            assert low <= high, f"{f.name}: low {low} > high {high}"
            if f.name not in _SIGNED_FIELDS:
                assert low >= 0, f"{f.name}: must be >= 0"
            if f.name in _PROBABILITY_FIELDS:
                assert high <= 1, f"{f.name}: a probability, got high {high}"
        assert self.min_read_chars[0] >= 1, "min_read_chars: must be >= 1"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def population_from_dict(
    d: Mapping[str, Any], people: People
) -> tuple[PopulationConfig, TelemetryConfig]:
    """`--population` JSON: one object whose fields are PopulationConfig's (both kinds) or
    TelemetryConfig's (telemetry people only), each [low, high] or a number (both ends)."""
    assert people in PEOPLE, f"people must be one of {PEOPLE}, got {people!r}"
    names = {f.name for f in fields(TelemetryConfig)}
    given = {k: v for k, v in d.items() if k in names}
    if given and people != "telemetry":
        raise ValueError(f"{', '.join(sorted(given))}: for --people telemetry only")
    values: dict[str, Range] = {}
    for name, v in given.items():
        if isinstance(v, int | float) and not isinstance(v, bool):
            values[name] = (float(v), float(v))
        elif isinstance(v, Sequence) and not isinstance(v, str) and len(v) == 2:
            values[name] = (float(v[0]), float(v[1]))
        else:
            raise ValueError(f"{name}: expected [low, high] or a number, got {v!r}")
    try:
        telemetry = replace(TelemetryConfig(), **values)
    except AssertionError as e:
        raise ValueError(str(e)) from None
    population = PopulationConfig.from_dict({k: v for k, v in d.items() if k not in names})
    return population, telemetry


def draw_telemetry(cfg: TelemetryConfig, rng: random.Random) -> TelemetryParams:
    """One person's telemetry habits, each uniform in its range, in field order (drawn after
    their PersonParams from the same rng)."""
    return TelemetryParams(**draw_params(TelemetryParams, cfg, _INT_FIELDS, rng))


# --- what they do with a suggestion --------------------------------------------------------


def counts_as_good(decision: Decision) -> bool | None:
    """What a telemetry person's session (switching and leaving, `step`) counts a suggestion
    as: None when typed through unread (they never saw whether it was any good), else whether
    it was good: taken, or correct though not needed. A proxy person counts accepts, as they
    take nearly every correct one; a telemetry person leaves most correct ones, and counting
    those as bad would make everyone switch and leave whatever the model."""
    if not decision.looked:
        return None
    return decision.action == "accept" or decision.verdict == "correct"


def in_comment(prefix: str) -> bool:
    """The cursor is on a comment line."""
    return line_before_cursor(prefix).lstrip().startswith("#")


def reads(habits: TelemetryParams, chars: int, latency_ms: float) -> bool:
    """Whether the person reads a suggestion at all: long enough and in time."""
    return chars >= habits.min_read_chars and latency_ms <= habits.patience_ms


def accept_logit(
    habits: TelemetryParams,
    chars: int,
    lines: int = 1,
    *,
    comment: bool = False,
    follows: bool = False,
    after_accept: bool = False,
) -> float:
    """The log-odds of taking a correct suggestion they read (the module docstring's sum)."""
    assert chars >= 1 and lines >= 1, f"a shown suggestion has text: {chars} chars, {lines} lines"
    return (
        habits.intercept
        + habits.length_slope * math.log(chars / LENGTH_REF_CHARS)
        + habits.extra_line_logit * (lines - 1)
        + habits.comment_logit * comment
        + habits.follows_logit * follows
        + habits.momentum_logit * after_accept
    )


def accept_probability(
    person: PersonParams,
    habits: TelemetryParams,
    verdict: Verdict,
    chars: int,
    lines: int = 1,
    *,
    comment: bool = False,
    follows: bool = False,
    after_accept: bool = False,
) -> float:
    """P(accept) of a shown suggestion that came in time: 0 below the person's reading length,
    else the logistic curve for a correct or close one, `accept_wrong` for a wrong one."""
    if chars < habits.min_read_chars:
        return 0.0
    if verdict == "wrong":
        return person.accept_wrong
    z = accept_logit(
        habits, chars, lines, comment=comment, follows=follows, after_accept=after_accept
    )
    if verdict == "close":
        z += habits.close_logit
    return 1.0 / (1.0 + math.exp(-z))


def decide_telemetry(
    person: PersonParams,
    habits: TelemetryParams,
    text: str,
    truth: str,
    *,
    prefix: str,
    latency_ms: float,
    after_accept: bool,
    max_delay_s: float,
    rng: random.Random,
    follows: bool = False,
) -> Decision:
    """What a telemetry person does with a shown suggestion `text` when the line really
    continues with `truth`. It reads only what they see: the text, the code (`prefix`, whether
    text `follows` the cursor), the latency they waited and their own memory (`after_accept`),
    never what the policy computed. Draws exactly four numbers from `rng` (delay, accept,
    reject-or-ignore, edit later) and a fifth only for an accepted close suggestion."""
    delay = min(max(MIN_DELAY_S, rng.expovariate(1.0 / person.decide_mean_s)), max_delay_s)
    u_accept, u_explicit, u_edit = rng.random(), rng.random(), rng.random()
    family = in_reject_family(prefix)
    verdict: Verdict = "wrong" if family else judge(text, truth, person.close_similarity)
    explicit = u_explicit < person.explicit_reject
    if family:
        return Decision(verdict, "reject" if explicit else "ignore", delay)
    if not reads(habits, len(text), latency_ms):
        return Decision(verdict, "ignore", MIN_DELAY_S, looked=False)  # typed through
    p_accept = accept_probability(
        person,
        habits,
        verdict,
        len(text),
        text.count("\n") + 1,
        comment=in_comment(prefix),
        follows=follows,
        after_accept=after_accept,
    )
    edited = habits.edit_later * habits.kept_when_edited + 1.0 - habits.edit_later
    expected = p_accept * edited * expected_taken(person, verdict, text, truth)
    if u_accept >= p_accept:
        return Decision(verdict, "reject" if explicit else "ignore", delay, expected_kept=expected)
    chars = taken_chars(person, verdict, text, truth, rng)
    kept = habits.kept_when_edited if u_edit < habits.edit_later else 1.0
    retained = kept * matched_fraction(text[:chars], truth)
    return Decision(verdict, "accept", delay, chars, retained, expected_kept=expected)
