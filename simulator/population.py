"""Simulated people: who they are, where their cursor is, what they do with a suggestion.

These are the proxy people (`--people proxy`, the control); simulator.telemetry's (the
default) add habits fitted to real telemetry and decide by their own rule.

Everything here is pure — a function of its arguments and a seeded `random.Random` (drawn in a
fixed order, so a seed replays the same people) — and tested with tables
(tests/simulator/test_population.py). No I/O, no clock: `simulator.run` does the waiting and
the HTTP.

A person judges a suggestion by the code itself (the held-out file says what the line really
is): *correct* when it is the rest of the line or a prefix of it, *close* when most of its
characters match the line in order (difflib), *wrong* otherwise. They accept correct ones
(almost always), close ones sometimes (now and then only the correct leading part), wrong ones
rarely; otherwise they press Esc or let the decision window pass. At each retention check they
report the fraction of the accepted text that matches the real line. A run of bad suggestions
makes them switch to another model for a while; suggestions that stay useless after a few
switches make them leave (churn), and a new person takes the seat.

The reject family: on a `def`/`class` line, with the cursor past the keyword, the person is
designing a new signature — the file's name and parameters are not what they will type, so any
suggestion there is wrong and every one is rejected. The family is visible in the prefix (the
model can learn to stay silent there) and a configurable share of cursors is drawn from it, so
"shown rate on contexts the people always reject" is a measurable learning signal.

Settled code: a share of people opt in to `code_settled` (`settles`, drawn from its own seeded
stream, so the people themselves are the same whatever the share). When they move on from a
line they report what finally stands after the request's cursor: the held-out line's true rest
(`settled_text`).

Adversaries (`seat_kinds`, `adversary_feedback`): the last seats of a run can hold people who do
not judge the code at all. `accept_all` accepts every suggestion at once, abstentions included,
and reports it fully kept at every retention check right away; `reject_all` rejects every one;
`random` flips a coin for each. They ask ten times as often as a person (`adversary_pause`), so
each one's rollouts are a large share of a training batch, and they never switch or leave.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from tabloop.core.corpus import CorpusLine, Cursor, cursor_in_line, prefix_match

Verdict = Literal["correct", "close", "wrong"]
AdversaryKind = Literal["accept_all", "reject_all", "random"]
ADVERSARY_KINDS: tuple[AdversaryKind, ...] = ("accept_all", "reject_all", "random")
# an adversary pauses this share of a person's pause between requests: ten times the rollouts
ADVERSARY_PAUSE_SHARE = 0.1
Action = Literal["accept", "reject", "ignore"]
Move = Literal["stay", "switch", "churn"]

REJECT_FAMILY_KEYWORDS = ("def ", "async def ", "class ")
MIN_DELAY_S = 0.15  # nobody reacts faster than this
SETTLED_TEXT_MAX_CHARS = 1000  # DESIGN.md: a code_settled text is at most 1,000 characters


# --- who -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PersonParams:
    """One person's habits (drawn from a PopulationConfig)."""

    accept_correct: float  # P(accept) of a suggestion that is the rest of the line or its prefix
    accept_close: float  # P(accept) of a close one (matched fraction >= close_similarity)
    accept_wrong: float  # P(accept) of a wrong one
    close_similarity: float  # matched fraction at which a suggestion counts as close
    partial_accept: float  # P(take only the leading part that matches) of an accepted close one
    explicit_reject: float  # P(press Esc) when not accepting; else the decision window passes
    decide_mean_s: float  # mean time from seeing a suggestion to accepting or rejecting it
    think_mean_s: float  # mean pause between completion requests (typing)
    switch_after: int  # consecutive bad shown suggestions before switching to another model
    switch_away_s: float  # how long the person stays on the other model
    churn_after_switches: int  # switches after which suggestions that stay useless mean leaving
    useless_window: int  # the last N shown suggestions judged for "useless"
    useless_accept_rate: float  # an accept rate below this over that window is useless


Range = tuple[float, float]

_INT_FIELDS = ("switch_after", "churn_after_switches", "useless_window")
_PROBABILITY_FIELDS = (
    "accept_correct",
    "accept_close",
    "accept_wrong",
    "close_similarity",
    "partial_accept",
    "explicit_reject",
    "useless_accept_rate",
)


@dataclass(frozen=True)
class PopulationConfig:
    """Ranges (low, high) each person's parameter is drawn from uniformly; see PersonParams.

    Times are seconds, sized for TABLOOP_PROFILE=sim (a 4 s decision window); decision delays
    are also capped by the served reward spec's decision window (see `decide`).
    """

    accept_correct: Range = (0.85, 1.0)
    accept_close: Range = (0.15, 0.45)
    accept_wrong: Range = (0.0, 0.04)
    close_similarity: Range = (0.7, 0.85)
    partial_accept: Range = (0.0, 0.6)
    explicit_reject: Range = (0.3, 0.8)
    decide_mean_s: Range = (0.5, 1.4)
    think_mean_s: Range = (0.8, 2.5)
    switch_after: Range = (5, 10)
    switch_away_s: Range = (5.0, 20.0)
    churn_after_switches: Range = (2, 4)
    useless_window: Range = (15, 30)
    useless_accept_rate: Range = (0.1, 0.25)
    # share of cursors drawn on def/class lines past the keyword (the always-rejected family);
    # natural draws land there too, about 5% of held-out cursors
    reject_family_share: float = 0.1

    def __post_init__(self) -> None:
        for f in fields(PersonParams):
            low, high = getattr(self, f.name)
            assert low <= high, f"{f.name}: low {low} > high {high}"
            assert low >= 0, f"{f.name}: must be >= 0"
            if f.name in _PROBABILITY_FIELDS:
                assert high <= 1, f"{f.name}: a probability, got high {high}"
        for name in ("switch_after", "useless_window"):
            assert getattr(self, name)[0] >= 1, f"{name}: must be >= 1"
        assert 0 <= self.reject_family_share <= 1, "reject_family_share must be in [0, 1]"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PopulationConfig:
        """From JSON: a field is [low, high] or a single number (both ends); missing: default."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown population field(s): {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, v in d.items():
            if name == "reject_family_share":
                values[name] = float(v)
            elif isinstance(v, int | float):
                values[name] = (float(v), float(v))
            elif isinstance(v, Sequence) and len(v) == 2:
                values[name] = (float(v[0]), float(v[1]))
            else:
                raise ValueError(f"{name}: expected [low, high] or a number, got {v!r}")
        try:
            return replace(cls(), **values)
        except AssertionError as e:
            raise ValueError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def draw_params(
    kind: Any, cfg: Any, int_fields: Sequence[str], rng: random.Random
) -> dict[str, Any]:
    """The fields of dataclass `kind`, each uniform in `cfg`'s range of the same name (the
    `int_fields` integers, inclusive), drawn in field order."""
    values: dict[str, Any] = {}
    for f in fields(kind):
        low, high = getattr(cfg, f.name)
        if f.name in int_fields:
            values[f.name] = rng.randint(int(low), int(high))
        else:
            values[f.name] = rng.uniform(low, high)
    return values


def draw_person(cfg: PopulationConfig, rng: random.Random) -> PersonParams:
    """One person, each parameter uniform in its range (integers inclusive), in field order."""
    return PersonParams(**draw_params(PersonParams, cfg, _INT_FIELDS, rng))


def settles(seed: int, slot: int, generation: int, share: float) -> bool:
    """Whether the person in seat `slot`, generation `generation` opted in to code_settled.

    Drawn from its own stream (never from the person's rng), so a run's people, cursors and
    decisions are the same for every share; share 0 draws nothing at all."""
    assert 0.0 <= share <= 1.0, f"share must be in [0, 1], got {share}"
    if share <= 0.0:
        return False
    return random.Random(f"settled:{seed}:{slot}:{generation}").random() < share


# --- where the cursor is -------------------------------------------------------------------


def line_before_cursor(prefix: str) -> str:
    return prefix.rsplit("\n", 1)[-1]


def in_reject_family(prefix: str) -> bool:
    """The cursor is past the keyword of a def/class line (decided by the prefix alone)."""
    return line_before_cursor(prefix).lstrip().startswith(REJECT_FAMILY_KEYWORDS)


def is_signature_line(line: str) -> bool:
    return line.lstrip().startswith(REJECT_FAMILY_KEYWORDS)


def cursor_at(cl: CorpusLine, col: int) -> Cursor:
    """The cursor at column `col` of a line (same shape as tabloop.core.corpus.cursor_in_line)."""
    before = "\n".join(cl.prefix_lines + (cl.line[:col],))
    after = "\n".join((cl.line[col:],) + cl.suffix_lines)
    return Cursor(cl.path, cl.line_no, before, after, cl.line[col:])


def family_cursor(cl: CorpusLine, rng: random.Random) -> Cursor | None:
    """A cursor past the keyword of a def/class line, before its last character; None when the
    line has no room for one."""
    line = cl.line.rstrip()
    stripped = line.lstrip()
    keyword = next((k for k in REJECT_FAMILY_KEYWORDS if stripped.startswith(k)), None)
    if keyword is None:
        return None
    low = len(line) - len(stripped) + len(keyword)
    if low > len(line) - 1:
        return None
    return cursor_at(cl, rng.randint(low, len(line) - 1))


class CursorSource:
    """Draws editing positions from a fixed set of (held-out) lines."""

    def __init__(self, lines: Sequence[CorpusLine]) -> None:
        assert lines, "no lines to place a cursor in"
        self.lines = list(lines)
        self.signature_lines = [cl for cl in self.lines if is_signature_line(cl.line)]

    def draw(self, rng: random.Random, family_share: float) -> Cursor:
        """With probability `family_share` a reject-family cursor, else one anywhere."""
        if self.signature_lines and rng.random() < family_share:
            for _ in range(100):
                cur = family_cursor(rng.choice(self.signature_lines), rng)
                if cur is not None:
                    return cur
        while True:
            cur = cursor_in_line(rng.choice(self.lines), rng)
            if cur is not None:
                return cur


def line_key(cursor: Cursor) -> tuple[str, int]:
    """The source line a cursor is on (file path, 0-based line): what fresh-line tracking keys."""
    return str(cursor.path), cursor.line_no


class SentLines:
    """The text of every whole line sent so far in any form: requests' prefixes and suffixes, and
    settled text. A cursor's line is fresh when its text (stripped) is none of them: then no
    memory could recall it."""

    def __init__(self) -> None:
        self.texts: set[str] = set()

    def add_request(self, prefix: str, suffix: str, *, prefix_cut: bool, suffix_cut: bool) -> None:
        """A request's text: its whole lines (not the cursor's, nor a line the cut split)."""
        above = prefix.split("\n")[1 if prefix_cut else 0 : -1]
        below = suffix.split("\n")[1 : -1 if suffix_cut else None]
        self.texts.update(line.strip() for line in (*above, *below))

    def add_settled(self, cursor: Cursor) -> None:
        """A code_settled report: the cursor's line as it finally stands."""
        self.texts.add(line_text(cursor).strip())

    def fresh(self, cursor: Cursor) -> bool:
        return line_text(cursor).strip() not in self.texts


def line_text(cursor: Cursor) -> str:
    """The whole line a cursor is on."""
    return cursor.prefix.rsplit("\n", 1)[-1] + cursor.rest_of_line


def settled_text(cursor: Cursor) -> str:
    """What finally stands from the cursor to the end of its line: the held-out line's true rest,
    cut to SETTLED_TEXT_MAX_CHARS (NUL characters, which the service refuses in code text, left
    out)."""
    return cursor.rest_of_line.replace("\x00", "")[:SETTLED_TEXT_MAX_CHARS]


def request_context(cursor: Cursor) -> tuple[str, str]:
    """(prefix, suffix) an editor sends: the suffix is the following lines, never the rest of
    the current line (that is what the person is about to type)."""
    return cursor.prefix, cursor.suffix[len(cursor.rest_of_line) :]


# --- what they do with a suggestion --------------------------------------------------------


def matched_fraction(text: str, truth: str) -> float:
    """The share of `text`'s characters that match `truth` in order (difflib matching blocks),
    trailing whitespace ignored on both; 0.0 for a blank text."""
    a, b = text.rstrip(), truth.rstrip()
    if not a.strip():
        return 0.0
    if b.startswith(a):
        return 1.0
    blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    return sum(m.size for m in blocks) / len(a)


def judge(text: str, truth: str, close_similarity: float) -> Verdict:
    if prefix_match(text, truth):
        return "correct"
    if matched_fraction(text, truth) >= close_similarity:
        return "close"
    return "wrong"


def common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Decision:
    verdict: Verdict  # how the person judged it ("wrong" for every reject-family suggestion)
    action: Action
    delay_s: float  # seconds after the suggestion appeared (for "ignore": when they move on)
    accepted_chars: int = 0  # how much of the suggestion was taken (0 unless accepted)
    retained_fraction: float = 0.0  # of the accepted text, what matches the real line
    looked: bool = True  # False: typed through unread (telemetry people, simulator.telemetry)
    # the characters the person keeps of it in expectation over their own draws (accept, how
    # much, later edits), the rest as it was: retained_chars without the coin flips' noise
    expected_kept: float = 0.0


def decide(
    person: PersonParams,
    text: str,
    truth: str,
    family: bool,
    max_delay_s: float,
    rng: random.Random,
) -> Decision:
    """What the person does with a shown suggestion `text` when the line really continues with
    `truth`. Draws exactly three numbers from `rng` (delay, accept, reject-or-ignore) and a
    fourth only for an accepted close suggestion (partial or whole)."""
    delay = min(max(MIN_DELAY_S, rng.expovariate(1.0 / person.decide_mean_s)), max_delay_s)
    verdict: Verdict = "wrong" if family else judge(text, truth, person.close_similarity)
    p_accept = (
        0.0
        if family
        else {
            "correct": person.accept_correct,
            "close": person.accept_close,
            "wrong": person.accept_wrong,
        }[verdict]
    )
    accept = rng.random() < p_accept
    explicit = rng.random() < person.explicit_reject
    expected = p_accept * expected_taken(person, verdict, text, truth)
    if not accept:
        return Decision(verdict, "reject" if explicit else "ignore", delay, expected_kept=expected)
    chars = taken_chars(person, verdict, text, truth, rng)
    retained = matched_fraction(text[:chars], truth)
    return Decision(verdict, "accept", delay, chars, retained, expected_kept=expected)


def taken_chars(
    person: PersonParams, verdict: Verdict, text: str, truth: str, rng: random.Random
) -> int:
    """How much of an accepted suggestion is taken: all of it, or of a close one, with
    probability `partial_accept`, only its leading part that matches (one draw, close only)."""
    if verdict == "close" and rng.random() < person.partial_accept:
        lead = common_prefix_len(text, truth)
        if lead > 0:
            return lead
    return len(text)


def expected_taken(person: PersonParams, verdict: Verdict, text: str, truth: str) -> float:
    """E[taken chars x the share of them that match `truth`] of an accept, over the partial
    draw of taken_chars: what an accept keeps, before any later edit."""

    def kept(chars: int) -> float:
        return chars * matched_fraction(text[:chars], truth)

    whole = kept(len(text))
    lead = common_prefix_len(text, truth)
    if verdict != "close" or lead == 0:
        return whole
    return person.partial_accept * kept(lead) + (1.0 - person.partial_accept) * whole


# --- switching and leaving -----------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """What a person remembers of the suggestions they were shown."""

    bad_run: int = 0  # consecutive shown suggestions not accepted
    switches: int = 0  # model switches so far
    recent: tuple[bool, ...] = field(default_factory=tuple)  # accepted?, the last shown ones


def step(session: Session, person: PersonParams, accepted: bool) -> tuple[Session, Move]:
    """After one shown suggestion: stay, switch to another model, or leave.

    Leaving needs `churn_after_switches` switches already and a full window of recent shown
    suggestions accepted less than `useless_accept_rate` of the time; it is checked first.
    """
    recent = (session.recent + (accepted,))[-person.useless_window :]
    bad_run = 0 if accepted else session.bad_run + 1
    s = Session(bad_run, session.switches, recent)
    useless = (
        len(recent) >= person.useless_window
        and sum(recent) / len(recent) < person.useless_accept_rate
    )
    if useless and session.switches >= person.churn_after_switches:
        return s, "churn"
    if bad_run >= person.switch_after:
        return Session(0, session.switches + 1, recent), "switch"
    return s, "stay"


# --- reward, as the service computes its decision part -------------------------------------


def size_scale(chars: int, chars_norm: float, chars_exponent: float) -> float:
    """DESIGN.md: (min(chars, 3 * chars_norm) / chars_norm) ** chars_exponent; 0 for none."""
    if chars <= 0:
        return 0.0
    return float((min(chars, 3 * chars_norm) / chars_norm) ** chars_exponent)


def decision_reward(spec: Mapping[str, Any], shown_chars: int, decision: Decision | None) -> float:
    """The reward's decision part for one rollout (no switch or churn share): 0 when nothing
    was shown (decision None), minus the reject penalty when rejected or ignored, else
    accept_reward * size_scale * share * retained_fraction. `spec` is the reward-spec JSON."""
    if decision is None:
        return float(spec["abstain_reward"])
    if decision.action != "accept":
        return -float(spec["reject_penalty"])
    chars = max(0, min(decision.accepted_chars, shown_chars))
    share = chars / shown_chars if shown_chars else 0.0
    scale = size_scale(chars, float(spec["chars_norm"]), float(spec["chars_exponent"]))
    return float(spec["accept_reward"]) * scale * share * decision.retained_fraction


def retention_delays(
    spec: Mapping[str, Any], accepted_after_s: float, margin_s: float
) -> list[float]:
    """Seconds after the accept at which to report retention: the spec's checks that land inside
    the reward horizon (counted from the suggestion) with `margin_s` to spare for delivery."""
    horizon = float(spec["horizon_s"])
    return [
        float(c)
        for c in spec["retention_checks_s"]
        if accepted_after_s + float(c) <= horizon - margin_s
    ]


def think_time(person: PersonParams, rng: random.Random) -> float:
    """Seconds of typing before the next request: exponential, capped at 4x the mean."""
    return min(rng.expovariate(1.0 / person.think_mean_s), 4 * person.think_mean_s)


# --- adversaries ---------------------------------------------------------------------------


def seat_kinds(
    users: int, adversaries: int, kinds: Sequence[AdversaryKind]
) -> list[AdversaryKind | None]:
    """Per seat: None for an honest person, else the adversary's kind. The last `adversaries`
    seats hold adversaries, taking `kinds` in turn; the honest seats keep their numbers (and so
    their seeds), so a run's honest people are those of a run with `users - adversaries` seats."""
    assert 0 <= adversaries < users, "adversaries must leave at least one honest seat"
    assert kinds and all(k in ADVERSARY_KINDS for k in kinds), f"kinds among {ADVERSARY_KINDS}"
    honest = users - adversaries
    return [None if slot < honest else kinds[(slot - honest) % len(kinds)] for slot in range(users)]


def adversary_pause(pace: PersonParams, rng: random.Random) -> float:
    """Seconds before an adversary's next request: a tenth of a person's (`think_time`), and
    never under MIN_DELAY_S."""
    return max(MIN_DELAY_S, ADVERSARY_PAUSE_SHARE * think_time(pace, rng))


def adversary_feedback(
    kind: AdversaryKind, shown: bool, text: str, checks_s: Sequence[float], rng: random.Random
) -> list[dict[str, Any]]:
    """The events (type and fields, without ids, person or time) an adversary sends at once
    about one suggestion, `shown` or not. accept_all: an accept of the whole suggestion and, when
    something was shown, a code_retained of 1.0 at each of `checks_s` (the reward spec's checks);
    reject_all: a reject; random: one or the other, even odds (one draw from `rng`, for that kind
    only). About an abstention they send the same verdict, with nothing to keep."""
    if kind == "random":
        kind = "accept_all" if rng.random() < 0.5 else "reject_all"
    if kind == "reject_all":
        return [{"type": "reject"}]
    assert kind == "accept_all", f"unknown adversary kind {kind!r}"
    if not shown:
        return [{"type": "accept"}]
    return [
        {"type": "accept", "accepted_chars": len(text)},
        *(
            {"type": "code_retained", "after_seconds": float(c), "retained_fraction": 1.0}
            for c in checks_s
        ),
    ]
