"""tabloop.core.stream.kafka.read_to_end against a scripted consumer: holes a crashed broker leaves
below its high watermark, and a broker that does not answer."""

from __future__ import annotations

from typing import Any

import pytest
from kafka.errors import KafkaTimeoutError

from tabloop.core.stream.kafka import read_to_end


class Scripted:
    """Partitions as lists of offsets that fetches can serve, each with a high watermark."""

    def __init__(self, served: dict[str, list[int]], hw: dict[str, int], answers: bool = True):
        self.served, self.hw, self.answers = served, hw, answers
        self.pos = {tp: 0 for tp in served}

    def position(self, tp: str) -> int:
        return self.pos[tp]

    def highwater(self, tp: str) -> int:
        return self.hw[tp]

    def poll(self, timeout_ms: int, max_records: int) -> dict[str, list[Any]]:
        out = {}
        for tp, offsets in self.served.items():
            got = [o for o in offsets if o >= self.pos[tp]]
            if got:
                out[tp] = got
                self.pos[tp] = got[-1] + 1
        return out

    def end_offsets(self, tps: list[str]) -> dict[str, int]:
        if not self.answers:
            raise KafkaTimeoutError("no answer")
        return {tp: self.hw[tp] for tp in tps}


def test_a_hole_at_the_end_is_read_past_when_the_broker_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = Scripted({"a": [0, 1, 2], "b": [0, 1, 2, 3]}, {"a": 6, "b": 4})  # a: 3-5 never stored
    with caplog.at_level("WARNING", logger="tabloop.core.stream.kafka"):
        got = read_to_end(c, ["a", "b"], timeout_s=10, hole_s=0.3)  # type: ignore[arg-type]
    assert sorted(got) == [0, 0, 1, 1, 2, 2, 3]
    assert "a: the broker reports offsets 3-5 but serves none of them" in caplog.text


def test_no_hole_is_assumed_while_the_broker_does_not_answer() -> None:
    c = Scripted({"a": [0, 1]}, {"a": 5}, answers=False)
    with pytest.raises(KafkaTimeoutError, match="could not read to the end"):
        read_to_end(c, ["a"], timeout_s=0.8, hole_s=0.2)  # type: ignore[arg-type]


def test_without_a_hole_it_returns_as_soon_as_everything_is_read() -> None:
    c = Scripted({"a": [0, 1, 2]}, {"a": 3})
    assert read_to_end(c, ["a"], timeout_s=10, hole_s=60) == [0, 1, 2]  # type: ignore[arg-type]
