"""The telemetry people: their calibration against the published rates (from seeded draws, no
other randomness), their decisions as tables, and the rule that they never read what the
policy computed."""

from __future__ import annotations

import ast
import inspect
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

import simulator.run
from simulator.cli import build_parser, config_from_args
from simulator.population import (
    MIN_DELAY_S,
    Decision,
    PersonParams,
    PopulationConfig,
    decide,
    draw_person,
)
from simulator.telemetry import (
    ACCEPT_BY_LENGTH,
    MULTI_LINE,
    PER_PERSON_ACCEPT,
    TelemetryConfig,
    TelemetryParams,
    accept_logit,
    accept_probability,
    counts_as_good,
    decide_telemetry,
    draw_telemetry,
    in_comment,
    population_from_dict,
)

# The population the calibration is checked on: 2,000 people drawn from fixed seeds.
PEOPLE_N = 2000


def population(
    telemetry: TelemetryConfig | None = None, n: int = PEOPLE_N
) -> list[tuple[PersonParams, TelemetryParams]]:
    out = []
    for i in range(n):
        rng = random.Random(f"calibration:{i}")
        person = draw_person(PopulationConfig(), rng)
        out.append((person, draw_telemetry(telemetry or TelemetryConfig(), rng)))
    return out


def bucket_rate(
    person: PersonParams, habits: TelemetryParams, lengths: range, after: bool
) -> float:
    """P(accept) of a correct one-line suggestion, averaged over the bucket's lengths."""
    ps = [accept_probability(person, habits, "correct", n, after_accept=after) for n in lengths]
    return sum(ps) / len(ps)


def stationary_curve(
    person: PersonParams, habits: TelemetryParams
) -> tuple[dict[tuple[int, int], float], float]:
    """The person's accept rate per length bucket and overall, on the reference mix (each
    bucket's lengths uniform, the buckets weighted equally), with momentum at its stationary
    share: s = r0 + s (r1 - r0), r0 and r1 the mix rates after a miss and after an accept."""
    buckets = [range(low, high + 1) for low, high in ACCEPT_BY_LENGTH]
    p0 = [bucket_rate(person, habits, b, False) for b in buckets]
    p1 = [bucket_rate(person, habits, b, True) for b in buckets]
    r0, r1 = sum(p0) / len(p0), sum(p1) / len(p1)
    s = r0 / (1 - r1 + r0)
    curve = {k: (1 - s) * a + s * b for k, a, b in zip(ACCEPT_BY_LENGTH, p0, p1, strict=True)}
    return curve, s


@pytest.fixture(scope="module")
def curves() -> list[tuple[dict[tuple[int, int], float], float]]:
    return [stationary_curve(p, h) for p, h in population()]


# the population's average by length bucket (with the defaults: 0.020, 0.254, 0.449, 0.661)
@pytest.mark.parametrize(
    ("bucket", "tolerance"),
    [((1, 5), 0.01), ((10, 20), 0.03), ((40, 80), 0.03), ((161, 320), 0.03)],
)
def test_population_acceptance_by_length_matches_the_telemetry(
    curves: list[tuple[dict[tuple[int, int], float], float]],
    bucket: tuple[int, int],
    tolerance: float,
) -> None:
    average = sum(c[bucket] for c, _ in curves) / len(curves)
    assert average == pytest.approx(ACCEPT_BY_LENGTH[bucket], abs=tolerance)


def test_per_person_accept_rates_span_a_factor_of_four(
    curves: list[tuple[dict[tuple[int, int], float], float]],
) -> None:
    # the data's 0.13 and 0.57 are the lowest and highest person of a small study: taken as the
    # 5th and 95th percentiles of a population (with the defaults: 0.132 and 0.570)
    rates = sorted(s for _, s in curves)
    p5, p95 = rates[len(rates) // 20], rates[len(rates) * 19 // 20]
    assert p5 == pytest.approx(PER_PERSON_ACCEPT[0], abs=0.03)
    assert p95 == pytest.approx(PER_PERSON_ACCEPT[1], abs=0.03)
    assert 3.0 <= p95 / p5 <= 5.5


def test_multi_line_share_of_accepted_characters() -> None:
    # CodeCompose: 16% of shown, 42% of accepted characters. A multi-line suggestion taken as
    # 3 lines of a single-line suggestion's length (our assumption); momentum left out
    people = population(n=200)
    lengths = [n for low, high in ACCEPT_BY_LENGTH for n in range(low, high + 1)]
    single = multi = 0.0
    for person, habits in people:
        for n in lengths:
            single += n * accept_probability(person, habits, "correct", n)
            m = 3 * n + 2
            multi += m * accept_probability(person, habits, "correct", m, lines=3)
    shown, accepted = MULTI_LINE
    share = shown * multi / (shown * multi + (1 - shown) * single)
    assert share == pytest.approx(accepted, abs=0.03)


# --- what one person does --------------------------------------------------------------------

PERSON = PersonParams(
    accept_correct=0.0,  # not read by telemetry people
    accept_close=0.0,  # not read by telemetry people
    accept_wrong=0.0,
    close_similarity=0.8,
    partial_accept=0.0,
    explicit_reject=0.0,
    decide_mean_s=1.0,
    think_mean_s=1.0,
    switch_after=3,
    switch_away_s=5.0,
    churn_after_switches=2,
    useless_window=4,
    useless_accept_rate=0.3,
)
# A person who takes every correct suggestion they read (log-odds 50), reads 4+ characters in
# under a second, and never rewrites; tests turn the rest on.
HABITS = TelemetryParams(
    intercept=50.0,
    length_slope=0.8,
    extra_line_logit=0.0,
    comment_logit=-1.0,
    follows_logit=-0.7,
    momentum_logit=1.0,
    close_logit=-1.5,
    min_read_chars=4,
    patience_ms=1000.0,
    edit_later=0.0,
    kept_when_edited=0.5,
)
MID = replace(HABITS, intercept=0.0)  # a person at even odds for 32 characters


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({"chars": 32}, 0.0, id="32-chars-is-the-intercept"),
        pytest.param({"chars": 64}, 0.8 * math.log(2), id="twice-as-long"),
        pytest.param({"chars": 32, "lines": 3}, 0.0, id="lines-add-nothing-by-default"),
        pytest.param({"chars": 32, "comment": True}, -1.0, id="comment-line"),
        pytest.param({"chars": 32, "follows": True}, -0.7, id="text-after-the-cursor"),
        pytest.param({"chars": 32, "after_accept": True}, 1.0, id="momentum"),
    ],
)
def test_accept_logit(kwargs: dict, expected: float) -> None:
    assert accept_logit(MID, **kwargs) == pytest.approx(expected)


def test_extra_lines_add_their_term() -> None:
    habits = replace(MID, extra_line_logit=-0.3)
    assert accept_logit(habits, 32, 4) == pytest.approx(-0.9)


@pytest.mark.parametrize("fragment", [")", "]", ":", "= 0", "):"])
def test_fragments_are_never_taken_by_the_default_people(fragment: str) -> None:
    for person, habits in population(n=300):
        assert accept_probability(person, habits, "correct", len(fragment)) == 0.0


def test_acceptance_rises_with_length() -> None:
    ps = [accept_probability(PERSON, MID, "correct", n) for n in (4, 10, 40, 160)]
    assert ps == sorted(ps) and ps[0] < 0.3 < ps[-1]


@pytest.mark.parametrize(
    ("verdict", "expected"),
    [
        ("correct", 0.5),
        ("close", 1 / (1 + math.exp(1.5))),  # lower than correct, same length curve
        ("wrong", 0.03),  # the person's accept_wrong, whatever the length
    ],
)
def test_accept_probability_by_verdict(verdict: str, expected: float) -> None:
    person = replace(PERSON, accept_wrong=0.03)
    assert accept_probability(person, MID, verdict, 32) == pytest.approx(expected)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("person", "habits", "text", "truth", "prefix", "latency_ms", "expected"),
    [
        pytest.param(
            PERSON,
            HABITS,
            "foo(a, b)",
            "foo(a, b)",
            "x = ",
            10.0,
            ("accept", "correct", 9, 1.0),
            id="correct-read-and-taken",
        ),
        pytest.param(
            PERSON,
            HABITS,
            "):",
            "):",
            "f(a",
            10.0,
            ("ignore", "correct", 0, 0.0),
            id="too-short-typed-through",
        ),
        pytest.param(
            PERSON,
            HABITS,
            "foo(a, b)",
            "foo(a, b)",
            "x = ",
            1500.0,
            ("ignore", "correct", 0, 0.0),
            id="too-slow-typed-through",
        ),
        pytest.param(
            replace(PERSON, explicit_reject=1.0),
            HABITS,
            "foo(a, b)",
            "foo(a, b)",
            "def f",
            10.0,
            ("reject", "wrong", 0, 0.0),
            id="reject-family-always-rejected",
        ),
        pytest.param(
            replace(PERSON, explicit_reject=1.0),
            HABITS,
            ")",
            ")",
            "def f(",
            10.0,
            ("reject", "wrong", 0, 0.0),
            id="reject-family-before-reading",
        ),
        pytest.param(
            PERSON,
            replace(HABITS, edit_later=1.0),
            "foo(a, b)",
            "foo(a, b)",
            "x = ",
            10.0,
            ("accept", "correct", 9, 0.5),
            id="edited-later-keeps-less",
        ),
        pytest.param(
            replace(PERSON, partial_accept=1.0),
            HABITS,
            "foo(a, c):",
            "foo(a, b):",
            "x = ",
            10.0,
            ("accept", "close", 7, 1.0),
            id="close-partial-accept",
        ),
        pytest.param(
            PERSON,
            HABITS,
            "bar(x, y)",
            "foo(a, b)",
            "x = ",
            10.0,
            ("ignore", "wrong", 0, 0.0),
            id="wrong-left",
        ),
        pytest.param(
            replace(PERSON, explicit_reject=1.0),
            replace(HABITS, intercept=-50.0),
            "foo(a, b)",
            "foo(a, b)",
            "x = ",
            10.0,
            ("reject", "correct", 0, 0.0),
            id="correct-but-not-for-this-person",
        ),
    ],
)
def test_decide_telemetry(
    person: PersonParams,
    habits: TelemetryParams,
    text: str,
    truth: str,
    prefix: str,
    latency_ms: float,
    expected: tuple[str, str, int, float],
) -> None:
    d = decide_telemetry(
        person,
        habits,
        text,
        truth,
        prefix=prefix,
        latency_ms=latency_ms,
        after_accept=False,
        max_delay_s=3.0,
        rng=random.Random(0),
    )
    assert (d.action, d.verdict, d.accepted_chars) == expected[:3]
    assert d.retained_fraction == pytest.approx(expected[3])
    typed_through = d.action == "ignore" and d.verdict == "correct"
    assert d.looked is not typed_through
    if typed_through:
        assert d.delay_s == MIN_DELAY_S  # at once, not looked at


@pytest.mark.parametrize(
    ("text", "truth"),
    [
        pytest.param("return value + offset", "return value + offset", id="correct"),
        pytest.param("return value + offsat", "return value + offset", id="close"),
        pytest.param("x = 1\ny = 2", "x = 1\ny = 3", id="close-block"),
        pytest.param("yield nothing at all", "return value + offset", id="wrong"),
    ],
)
@pytest.mark.parametrize("people", ["telemetry", "proxy"])
def test_expected_kept_is_the_mean_of_the_retained_characters(
    text: str, truth: str, people: str
) -> None:
    """Decision.expected_kept is what the person keeps of a suggestion on average over their
    own draws: within 4 standard errors of the mean retained characters of 20,000 decisions
    (partial takes and, for telemetry people, later edits on); the same for every draw."""
    person = replace(
        PERSON, partial_accept=0.5, accept_correct=0.7, accept_close=0.5, accept_wrong=0.3
    )
    habits = replace(MID, edit_later=0.4, length_slope=0.0)
    kept, expected = [], set()
    for seed in range(20_000):
        rng = random.Random(seed)
        d = (
            decide_telemetry(
                person,
                habits,
                text,
                truth,
                prefix="x = ",
                latency_ms=10.0,
                after_accept=False,
                max_delay_s=3.0,
                rng=rng,
            )
            if people == "telemetry"
            else decide(person, text, truth, False, 3.0, rng)
        )
        kept.append(d.accepted_chars * d.retained_fraction if d.action == "accept" else 0.0)
        expected.add(round(d.expected_kept, 9))
    assert len(expected) == 1
    mean = sum(kept) / len(kept)
    se = (sum((k - mean) ** 2 for k in kept) / len(kept)) ** 0.5 / len(kept) ** 0.5
    assert mean > 0
    assert expected.pop() == pytest.approx(mean, abs=4 * se)


def decide_with(
    rng: random.Random, habits: TelemetryParams, text: str, prefix: str = "x = "
) -> str:
    return decide_telemetry(
        PERSON,
        habits,
        text,
        text,
        prefix=prefix,
        latency_ms=10.0,
        after_accept=False,
        max_delay_s=3.0,
        rng=rng,
    ).action


@pytest.mark.parametrize(
    ("text", "prefix"),
    [("foo(a, b)", "x = "), (")", "x = "), ("foo(a, b)", "def f"), ("bar(x, y)", "x = ")],
)
def test_decide_telemetry_draws_four_numbers(text: str, prefix: str) -> None:
    # accepted, typed through, reject family, wrong: the rest of the stream is the same
    rng, fresh = random.Random(7), random.Random(7)
    decide_with(rng, HABITS, text, prefix)
    for _ in range(4):
        fresh.random()
    assert rng.random() == fresh.random()


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(Decision("correct", "accept", 1.0, 9, 1.0), True, id="taken"),
        pytest.param(Decision("correct", "ignore", 1.0), True, id="correct-but-not-needed"),
        pytest.param(Decision("close", "reject", 1.0), False, id="close-left"),
        pytest.param(Decision("wrong", "ignore", 1.0), False, id="wrong-left"),
        pytest.param(Decision("wrong", "accept", 1.0, 3, 0.2), True, id="wrong-but-taken"),
        pytest.param(
            Decision("correct", "ignore", MIN_DELAY_S, looked=False), None, id="typed-through"
        ),
    ],
)
def test_counts_as_good(decision: Decision, expected: bool | None) -> None:
    assert counts_as_good(decision) is expected


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [("x = 1\n    # compute the ", True), ("# a", True), ("x = 1  # the ", False), ("x = ", False)],
)
def test_in_comment(prefix: str, expected: bool) -> None:
    assert in_comment(prefix) is expected


# --- never what the policy computed ------------------------------------------------------------


def test_decide_telemetry_takes_only_what_a_person_sees() -> None:
    params = inspect.signature(decide_telemetry).parameters
    assert {name: p.annotation for name, p in params.items()} == {
        "person": "PersonParams",  # their own habits
        "habits": "TelemetryParams",
        "text": "str",  # the suggestion shown
        "truth": "str",  # the code they are writing
        "prefix": "str",
        "latency_ms": "float",  # how long they waited
        "after_accept": "bool",  # their own memory
        "max_delay_s": "float",  # the reward's decision window
        "rng": "random.Random",
        "follows": "bool",
    }


ALLOWED_RESPONSE_FIELDS = {"text", "shown", "latency_ms"}
DECIDERS = {"decide", "decide_telemetry"}


def response_fields(node: ast.AST) -> set[str]:
    """The fields of `resp` that `node` reads; fails on any other use of `resp` (passing it
    whole, a computed key)."""
    found: set[str] = set()
    allowed_uses: set[int] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "resp":
            assert isinstance(n.slice, ast.Constant), ast.unparse(n)
            found.add(str(n.slice.value))
            allowed_uses.add(id(n.value))
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "resp"
            and n.func.attr == "get"
        ):
            assert isinstance(n.args[0], ast.Constant), ast.unparse(n)
            found.add(str(n.args[0].value))
            allowed_uses.add(id(n.func.value))
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id == "resp":
            assert id(n) in allowed_uses, (
                f"the response reaches a decision whole: {ast.unparse(node)}"
            )
    return found


def test_the_decision_in_run_reads_only_text_shown_and_latency() -> None:
    tree = ast.parse(Path(inspect.getfile(simulator.run)).read_text())
    sim = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Simulation")
    person = next(n for n in sim.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "person")
    assigned: dict[str, list[ast.AST]] = {}
    for n in ast.walk(person):
        if isinstance(n, ast.Assign):
            for target in n.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        assigned.setdefault(name.id, []).append(n.value)
    calls = []  # (the call, the condition it is under)
    for n in ast.walk(person):
        if isinstance(n, ast.If):
            for stmt in n.body:
                for c in ast.walk(stmt):
                    if isinstance(c, ast.Call) and ast.unparse(c.func) in DECIDERS:
                        calls.append((c, n.test))
    assert {ast.unparse(c.func) for c, _ in calls} == DECIDERS
    for call, test in calls:
        read = response_fields(test)
        seen: set[str] = set()
        todo: list[ast.AST] = [call, test]
        while todo:  # the call, its condition, and what their names were assigned from
            node = todo.pop()
            read |= response_fields(node)
            for name in ast.walk(node):
                if isinstance(name, ast.Name) and name.id not in seen:
                    seen.add(name.id)
                    todo.extend(assigned.get(name.id, []))
        assert read <= ALLOWED_RESPONSE_FIELDS, ast.unparse(call)


# --- the population and its configuration ------------------------------------------------------


def test_draw_telemetry_is_seeded_in_range_and_after_the_proxy_draws() -> None:
    cfg = TelemetryConfig()
    rng_a, rng_b = random.Random("0:0:0"), random.Random("0:0:0")
    proxy = draw_person(PopulationConfig(), rng_a)
    assert draw_person(PopulationConfig(), rng_b) == proxy  # the person is the proxy one
    a, b = draw_telemetry(cfg, rng_a), draw_telemetry(cfg, rng_b)
    assert a == b
    for name, value in a.__dict__.items():
        low, high = getattr(cfg, name)
        assert low <= value <= high, name
    assert isinstance(a.min_read_chars, int)


def test_population_from_dict_splits_the_two_configs() -> None:
    pop, tel = population_from_dict(
        {"accept_close": [0.1, 0.3], "min_read_chars": 6, "intercept": [-1, 0]}, "telemetry"
    )
    assert pop.accept_close == (0.1, 0.3)
    assert tel.min_read_chars == (6.0, 6.0) and tel.intercept == (-1.0, 0.0)
    assert tel.length_slope == TelemetryConfig().length_slope


@pytest.mark.parametrize(
    ("given", "people"),
    [
        ({"min_read_chars": 6}, "proxy"),  # a telemetry field for the control
        ({"min_read_chars": 0}, "telemetry"),  # everything is long enough to read
        ({"edit_later": 1.5}, "telemetry"),
        ({"intercept": [1.0, -1.0]}, "telemetry"),
        ({"intercept": "high"}, "telemetry"),
        ({"accept_typo": 0.1}, "telemetry"),
    ],
)
def test_population_from_dict_refuses(given: dict, people: str) -> None:
    with pytest.raises(ValueError):
        population_from_dict(given, people)  # type: ignore[arg-type]


def test_short_takers_and_short_refusers() -> None:
    # the docstring's two populations for learning tests
    _, takers = population_from_dict(
        {"min_read_chars": 1, "length_slope": 0.0, "intercept": [2.0, 3.5]}, "telemetry"
    )
    _, refusers = population_from_dict({"min_read_chars": 6}, "telemetry")
    for person, habits in population(takers, n=200):
        assert accept_probability(person, habits, "correct", 1) >= 0.85
    for person, habits in population(refusers, n=200):
        assert all(accept_probability(person, habits, "correct", n) == 0.0 for n in range(1, 6))
        assert accept_probability(person, habits, "correct", 6) > 0.0


@pytest.mark.parametrize(("argv", "people"), [([], "telemetry"), (["--people", "proxy"], "proxy")])
def test_cli_people(argv: list[str], people: str) -> None:
    args = build_parser().parse_args(["--api", "http://x", "--key", "k", *argv])
    cfg = config_from_args(args)
    assert cfg.people == people
    assert cfg.telemetry == TelemetryConfig()


def test_cli_population_json_reaches_the_telemetry_config(tmp_path: Path) -> None:
    path = tmp_path / "refusers.json"
    path.write_text('{"min_read_chars": 6, "accept_wrong": 0.0}')
    args = build_parser().parse_args(["--api", "http://x", "--key", "k", "--population", str(path)])
    cfg = config_from_args(args)
    assert cfg.telemetry.min_read_chars == (6.0, 6.0)
    assert cfg.population.accept_wrong == (0.0, 0.0)
