"""Event validation, table-driven: each type valid and invalid, with the reason named."""

from __future__ import annotations

import pytest

from service.events.schemas import EVENT_TYPES, parse_event
from tabloop.testing.factories import event


@pytest.mark.parametrize("type_", EVENT_TYPES)
def test_each_type_valid(type_: str) -> None:
    parsed = parse_event(event(type_))
    assert parsed["type"] == type_


@pytest.mark.parametrize(
    ("type_", "override", "reason"),
    [
        # common fields
        ("accept", {"event_id": None}, "event_id: Field required"),
        ("accept", {"event_id": "not-a-uuid"}, "event_id: must be a UUID"),
        ("accept", {"event_id": 12345}, "event_id: Input should be a valid string"),
        ("reject", {"user_id": ""}, "user_id: String should have at least 1 character"),
        ("reject", {"user_id": "u" * 257}, "user_id: String should have at most 256"),
        ("reject", {"user_id": "u\x00"}, "user_id: must not contain NUL"),
        ("model_switch", {"to_model": "a\x00b"}, "to_model: must not contain NUL"),
        ("churn", {"occurred_at": "yesterday"}, "occurred_at: must be an RFC 3339"),
        ("churn", {"occurred_at": "2026-11-29T12:00:00"}, "occurred_at: must carry a time zone"),
        ("churn", {"occurred_at": 1764417600}, "occurred_at: Input should be a valid string"),
        ("accept", {"type": "acept"}, "type: must be one of"),
        ("accept", {"type": None}, "type: missing"),
        ("accept", {"color": "red"}, "color: unknown field"),
        # accept
        ("accept", {"suggestion_id": None}, "suggestion_id: Field required"),
        (
            "accept",
            {"accepted_chars": -1},
            "accepted_chars: Input should be greater than or equal to 0",
        ),
        ("accept", {"accepted_chars": "12"}, "accepted_chars: Input should be a valid integer"),
        ("accept", {"accepted_chars": 1.5}, "accepted_chars: Input should be a valid integer"),
        # reject
        ("reject", {"suggestion_id": "x"}, "suggestion_id: must be a UUID"),
        # code_retained
        (
            "code_retained",
            {"retained_fraction": 1.01},
            "retained_fraction: Input should be less than or equal to 1",
        ),
        (
            "code_retained",
            {"retained_fraction": -0.1},
            "retained_fraction: Input should be greater than or equal to 0",
        ),
        (
            "code_retained",
            {"retained_fraction": True},
            "retained_fraction: Input should be a valid number",
        ),
        ("code_retained", {"after_seconds": None}, "after_seconds: Field required"),
        (
            "code_retained",
            {"after_seconds": -5},
            "after_seconds: Input should be greater than or equal to 0",
        ),
        (
            "code_retained",
            {"after_seconds": 1e300},
            "after_seconds: Input should be less than or equal to",
        ),
        # code_settled
        ("code_settled", {"text": "x" * 1001}, "text: String should have at most 1000"),
        ("code_settled", {"text": 42}, "text: Input should be a valid string"),
        ("code_settled", {"text": ["x"]}, "text: Input should be a valid string"),
        ("code_settled", {"text": "a\x00b"}, "text: must not contain NUL"),
        ("code_settled", {"text": None}, "text: Field required"),
        ("code_settled", {"suggestion_id": None}, "suggestion_id: Field required"),
        ("code_settled", {"suggestion_id": "x"}, "suggestion_id: must be a UUID"),
        ("code_settled", {"after_seconds": None}, "after_seconds: Field required"),
        (
            "code_settled",
            {"after_seconds": -1},
            "after_seconds: Input should be greater than or equal to 0",
        ),
        (
            "code_settled",
            {"after_seconds": -0.5},
            "after_seconds: Input should be greater than or equal to 0",
        ),
        (
            "code_settled",
            {"after_seconds": 1e300},
            "after_seconds: Input should be less than or equal to",
        ),
        ("code_settled", {"after_seconds": "30"}, "after_seconds: Input should be a valid number"),
        ("code_settled", {"after_seconds": True}, "after_seconds: Input should be a valid number"),
        ("code_settled", {"retained_fraction": 0.5}, "retained_fraction: unknown field"),
        # model_switch
        ("model_switch", {"to_model": None}, "to_model: Field required"),
        ("model_switch", {"from_model": ""}, "from_model: String should have at least 1 character"),
        # churn
        ("churn", {"reason": "x" * 501}, "reason: String should have at most 500"),
        ("churn", {"reason": 7}, "reason: Input should be a valid string"),
    ],
)
def test_invalid_events_name_the_reason(type_: str, override: dict, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_event(event(type_, **override))
    assert reason in str(info.value)


@pytest.mark.parametrize("raw", [None, 1, "accept", [], ["accept"]])
def test_non_objects_are_rejected(raw: object) -> None:
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_event(raw)


def test_normalizes_ids_and_times() -> None:
    ev = event(
        "accept",
        event_id="0B6F1C1E-8A4E-4C3B-9D8E-2F1A3B4C5D6E",
        occurred_at="2026-11-29T13:00:00+01:00",
    )
    parsed = parse_event(ev)
    assert parsed["event_id"] == "0b6f1c1e-8a4e-4c3b-9d8e-2f1a3b4c5d6e"
    assert parsed["occurred_at"] == "2026-11-29T12:00:00Z"


def test_optional_fields_may_be_absent() -> None:
    assert "accepted_chars" not in parse_event(event("accept", accepted_chars=None))
    assert "reason" not in parse_event(event("churn", reason=None))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"after_seconds": 30}, {"after_seconds": 30.0}),  # an int is a JSON number too
        ({"after_seconds": 0}, {"after_seconds": 0.0}),
        ({"after_seconds": 12.5}, {"after_seconds": 12.5}),
        ({"text": ""}, {"text": ""}),  # the rest of the line was deleted
        ({"text": "y" * 1000}, {"text": "y" * 1000}),
        ({"text": "漢" * 1000}, {"text": "漢" * 1000}),  # 1,000 characters, not bytes
        ({"text": "  ä → 😀\t"}, {"text": "  ä → 😀\t"}),
    ],
)
def test_code_settled_valid(override: dict, expected: dict) -> None:
    parsed = parse_event(event("code_settled", **override))
    assert {k: parsed[k] for k in expected} == expected
    assert isinstance(parsed["after_seconds"], float)


@pytest.mark.parametrize("text", ["SECRET-CODE-" + "z" * 1000, "SECRET-CODE-\x00"])
def test_code_settled_errors_never_echo_the_text(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_event(event("code_settled", text=text))
    assert "text" in str(info.value) and "SECRET-CODE" not in str(info.value)
