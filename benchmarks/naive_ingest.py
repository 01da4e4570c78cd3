"""The naive ingestion endpoint that benchmarks/ingest.py measures tabloop against.

    python benchmarks/naive_ingest.py PORT POSTGRES_URL KAFKA_BOOTSTRAP

The straightforward design: for each event of a batch, validate it (the same validation as
tabloop), one SQLAlchemy ORM insert + commit, and one synchronous Kafka send
(`producer.send(...).get()`, acks=all). Durable per event, like tabloop's 202 is per batch.
No auth, no dead letters, no dedup: less work than tabloop does, not more.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Any

import orjson
import sqlalchemy as sa
import uvicorn
from fastapi import FastAPI
from kafka import KafkaProducer
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Session, mapped_column

from service.events.schemas import parse_event

TOPIC = "bench.naive"


class Base(DeclarativeBase):
    pass


class NaiveEvent(Base):
    __tablename__ = "naive_events"
    event_id = mapped_column(sa.String(36), primary_key=True)
    type = mapped_column(sa.String(32), nullable=False)
    user_id = mapped_column(sa.String(256), nullable=False, index=True)
    suggestion_id = mapped_column(sa.String(36), index=True)
    occurred_at = mapped_column(sa.DateTime(timezone=True), nullable=False)
    received_at = mapped_column(sa.DateTime(timezone=True), nullable=False)
    payload = mapped_column(JSONB, nullable=False)


def naive_app(database_url: str, bootstrap: str) -> FastAPI:
    engine = sa.create_engine(database_url, pool_size=32, max_overflow=32)
    Base.metadata.create_all(engine)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/events", status_code=202)
    def post_events(batch: dict[str, Any]) -> dict[str, Any]:
        for raw in batch["events"]:
            ev = parse_event(raw)
            with Session(engine) as session:
                session.add(
                    NaiveEvent(
                        event_id=ev["event_id"],
                        type=ev["type"],
                        user_id=ev["user_id"],
                        suggestion_id=ev.get("suggestion_id"),
                        occurred_at=datetime.fromisoformat(ev["occurred_at"]),
                        received_at=datetime.now(UTC),
                        payload=ev,
                    )
                )
                session.commit()
            producer.send(TOPIC, key=ev["user_id"].encode(), value=orjson.dumps(ev)).get(30)
        return {"accepted": len(batch["events"]), "duplicates": 0, "rejected": []}

    return app


if __name__ == "__main__":
    port, url, bootstrap = sys.argv[1:4]
    uvicorn.run(
        naive_app(url, bootstrap),
        host="127.0.0.1",
        port=int(port),
        log_level="warning",
        access_log=False,
    )
