"""Writing mode: a team writes files top to bottom; the report counts useful characters."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from simulator import report as rpt
from simulator.population import SentLines
from simulator.run import cursor_rng
from simulator.writing import WritingSource
from tabloop.core.corpus import usefulness


def test_people_write_their_own_files_top_to_bottom(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import os\n\nx = compute(1)\ny = other()\n")
    b.write_text("import os\nz = compute(2)\n")
    source, rng = WritingSource([a, b]), random.Random(0)
    alice = [source.draw("alice", rng) for _ in range(3)]
    bob = [source.draw("bob", rng) for _ in range(2)]
    assert [c.path for c in alice] == [a, a, a] and [c.path for c in bob] == [b, b]
    assert [c.line_no for c in alice] == [0, 2, 3]  # the blank line is skipped
    for cursor in alice + bob:
        lines = cursor.path.read_text().split("\n")
        above = "\n".join(lines[: cursor.line_no])
        assert cursor.suffix == "" and cursor.prefix.startswith(above)
        assert lines[cursor.line_no] == cursor.prefix.split("\n")[-1] + cursor.rest_of_line
        # the truth a suggestion of several lines is judged against: the lines as written
        assert cursor.truth_after() == cursor.rest_of_line
        assert cursor.truth_after(1) == "\n".join(
            [cursor.rest_of_line, *lines[cursor.line_no + 1 : cursor.line_no + 2]]
        )
    # when every file has been started, the next person starts the first again
    carol = source.draw("carol", rng)
    assert carol.path == a and carol.line_no == 0

    # fresh: the line's text never sent in any form; here bob's `import os` was (alice's file
    # above her later cursors), and so is a line once settled
    sent = SentLines()
    fresh = []
    for cursor in (*alice, *bob):
        sent.add_request(cursor.prefix, cursor.suffix, prefix_cut=False, suffix_cut=False)
        fresh.append(sent.fresh(cursor))
    assert fresh == [True, True, True, False, True]
    sent.add_settled(bob[1])
    assert not sent.fresh(bob[1])


def test_a_line_is_sent_by_a_prefix_or_a_suffix_but_not_by_its_cut_or_the_cursor() -> None:
    sent = SentLines()
    sent.add_request(
        "ut_line = 1\nkept = 2\nx = f(", "\nbelow = 3\ncut_li", prefix_cut=True, suffix_cut=True
    )
    assert sent.texts == {"kept = 2", "below = 3"}
    sent.add_request("a\n", "\nlast\n", prefix_cut=False, suffix_cut=False)
    assert {"a", "last", ""} <= sent.texts


def record(text: str, rest: str) -> rpt.RequestRecord:
    useful, whole = usefulness(text, rest)
    return rpt.RequestRecord(
        t=0.0,
        user_id="u",
        version=1,
        shown=bool(text),
        family=False,
        shown_chars=len(text),
        verdict=None,
        action="accept" if text else "abstained",
        accepted_chars=0,
        retained_chars=0.0,
        reward=0.0,
        latency_ms=5.0,
        useful_chars=useful,
        whole_line=whole,
    )


def test_usefulness_counts_the_characters_a_person_can_keep() -> None:
    assert usefulness("abc)  ", "abc)") == (4, True)
    assert usefulness("ab", "abc)") == (2, False)
    assert usefulness("xb", "abc)") == (0, False)
    assert usefulness("   ", "   x") == (0, False)


def test_a_suggestion_of_several_lines_is_judged_against_the_lines_as_written(
    tmp_path: Path,
) -> None:
    a = tmp_path / "a.py"
    a.write_text("def f(x):\n    y = x + 1\n    return y\n")
    cursor = WritingSource([a], 0).draw("u", random.Random(0))
    assert cursor.line_no == 0 and cursor.suffix == ""
    right = cursor.rest_of_line + "\n    y = x + 1"
    assert usefulness(right, cursor.truth_after(1)) == (len(right), True)
    assert usefulness(right + "\n    return x", cursor.truth_after(2))[0] == 0
    # the report says how much of what was shown, and of what was kept, had several lines
    one = replace(record("ab", "abc"), shown_lines=1, retained_chars=2.0)
    two = replace(record(right, cursor.truth_after(1)), shown_lines=2, retained_chars=6.0)
    m = rpt.metrics([one, two, record("", "x")])
    assert (m["multi_line_of_shown"], m["multi_line_of_kept"]) == (0.5, 0.75)


def test_useful_characters_and_whole_lines_per_request() -> None:
    records = [record("abc)", "abc)"), record("ab", "abc)"), record("xyz", "abc)"), record("", "a")]
    m = rpt.metrics(records)
    assert m["useful_chars_per_100"] == 100 * (4 + 2) / 4
    assert m["whole_line_rate"] == 1 / 4
    assert m["exact_of_shown"] == 1 / 3
    assert m["wrong_shown_per_request"] == 1 / 4


def test_with_a_seed_every_run_asks_at_the_same_column_and_draws_the_same_decision(
    tmp_path: Path,
) -> None:
    """Common random numbers: a learning run and its paused control of one seed ask at the same
    column of a line whoever writes it, and a telemetry person decides there with the same draws
    (simulator.run.cursor_rng); another seed draws other columns."""
    a = tmp_path / "a.py"
    a.write_text("".join(f"value_{i} = compute_something({i}, more_args)\n" for i in range(40)))

    def columns(seed: int, person: str, rng_seed: int) -> list[int]:
        source = WritingSource([a], seed)
        cursors = [source.draw(person, random.Random(rng_seed)) for _ in range(40)]
        return [len(c.prefix) for c in cursors]

    assert columns(7, "alice", 1) == columns(7, "bob", 2)
    assert columns(7, "alice", 1) != columns(8, "alice", 1)
    cursor = WritingSource([a], 7).draw("alice", random.Random(0))
    draws = [cursor_rng(7, cursor).random() for _ in range(2)]
    assert draws[0] == draws[1] != cursor_rng(8, cursor).random()
