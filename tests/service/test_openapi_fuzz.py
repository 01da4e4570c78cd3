"""The API against its own OpenAPI schema (schemathesis): every operation, valid and invalid
inputs, with a key holding every scope. No 5xx, and every response (status code, content type,
headers, body) is one the schema documents.

Each mode gets its own running service with the tiny policy live, so the destructive admin
routes (rollback, deploy, pause, key revocation, reward spec) are fuzzed too: they can only
disturb this service. Bounded and seeded: a fixed seed, `FUZZ_EXAMPLES` generated cases per
operation and mode in the fuzzing phase, plus the examples and coverage phases.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tabloop.core.db import make_engine
from tabloop.core.keys import SCOPES, create_key
from tabloop.core.registry import bootstrap

FUZZ_EXAMPLES = 25
SEED = 20261129

# Operations whose valid inputs JSON Schema cannot describe, so "a schema-valid request is
# accepted" (schemathesis ST202) cannot hold: a checkpoint must match its own sha256 sums, a
# replay's `to` must be after its `from`, a reward spec's windows must fit in its horizon.
# Every other check (no 5xx, documented status codes, bodies, headers, invalid input refused)
# runs on them as on every operation.
CROSS_FIELD = {
    "POST /admin/policies",
    "POST /admin/replay",
    "PUT /admin/reward-spec",
    "GET /admin/metrics",
}  # at most 500 buckets per window, at most 30 days

TALLY: Counter[tuple[str, str, int]] = Counter()  # (mode, operation, status) -> cases


class FuzzTarget:
    def __init__(self, mode: str, url: str, token: str) -> None:
        self.mode, self.url = mode, url
        self.headers = {"Authorization": f"Bearer {token}"}


@pytest.fixture
def fuzz_target(
    mode: str, settings_factory: Any, tiny_checkpoint_factory: Any, service_factory: Any
) -> Iterator[FuzzTarget]:
    # Rate limits are their own test (tests/service/auth/test_security.py); here they would
    # only turn generated cases into 429s.
    settings = settings_factory(
        base_checkpoint=tiny_checkpoint_factory(0),
        policy_poll_interval_s=0.2,
        rate_limit_per_s=1e6,
        rate_limit_burst=1_000_000,
    )
    engine = make_engine(settings)
    with engine.begin() as conn:
        bootstrap(conn, settings.base_checkpoint)
        _key, token = create_key(conn, name="fuzz", scopes=frozenset(SCOPES))
    engine.dispose()
    svc = service_factory(settings)
    yield FuzzTarget(mode, svc.url, token)
    cases = {k: n for k, n in TALLY.items() if k[0] == mode}
    by_status = Counter()
    for (_m, _op, status), n in cases.items():
        by_status[status] += n
    operations = len({op for _m, op, _s in cases})
    print(
        f"\nschemathesis [{mode}]: {sum(cases.values())} cases over {operations} operations; "
        f"by status {dict(sorted(by_status.items()))}"
    )


def load_schema(target: FuzzTarget) -> Any:
    config = SchemathesisConfig.from_dict(
        {
            "seed": SEED,
            "base-url": target.url,
            "headers": target.headers,
            "request-timeout": 30,
            "generation": {"deterministic": True, "database": "none"},
            # A string past its maxLength can make a body past TABLOOP_MAX_BODY_BYTES, refused whole
            # (413, documented) before it is validated: a rejection too.
            "checks": {
                "negative_data_rejection": {
                    "expected-statuses": [
                        "400",
                        "401",
                        "403",
                        "404",
                        "405",
                        "406",
                        "409",
                        "413",
                        "415",
                        "422",
                        "428",
                        "429",
                        "5xx",
                    ]
                }
            },
        }
    )
    return schemathesis.openapi.from_url(target.url + "/openapi.json", config=config)


# schemathesis's own pytest integration (`schemathesis.pytest.from_fixture`) does not run under
# pytest 9.2 (it sets a node attribute pytest removed), so each operation's strategies are run
# here with plain hypothesis: the schema's examples, then valid (positive) and invalid
# (negative) inputs.
def test_api_conforms_to_its_schema(fuzz_target: FuzzTarget) -> None:
    schema = load_schema(fuzz_target)
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]

    def check(case: Any) -> None:
        response = case.call(base_url=fuzz_target.url, headers=fuzz_target.headers)
        TALLY[(fuzz_target.mode, case.operation.label, response.status_code)] += 1
        assert response.status_code < 500, (response.status_code, response.text)
        skip = [positive_data_acceptance] if case.operation.label in CROSS_FIELD else []
        case.validate_response(response, headers=fuzz_target.headers, excluded_checks=skip)

    for op in operations:
        strategies = [("examples", s) for s in schema.get_strategies_from_examples(op)]
        strategies += [(m.value, op.as_strategy(generation_mode=m)) for m in GenerationMode]
        for name, strategy in strategies:
            examples = FUZZ_EXAMPLES if name != "examples" else 1

            @settings(
                max_examples=examples,
                derandomize=True,
                database=None,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=strategy)
            def run(case: Any) -> None:
                check(case)

            try:
                run()
            except Unsatisfiable:  # no invalid input exists (an operation without parameters)
                assert name == "negative", f"{op.label}: no {name} case could be generated"
            except (Exception, BaseExceptionGroup) as e:  # all operations' failures, then fail
                failures.append(f"{op.label} ({name}): {type(e).__name__}: {str(e)[:3000]}")
    assert not failures, "\n\n".join(failures)
