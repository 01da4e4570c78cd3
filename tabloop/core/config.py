"""Settings: one object per process, built from `TABLOOP_*` environment variables at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tabloop.core.policy.defaults import DEFAULT_STOP_LOGPROB, DEFAULT_TEMPERATURE, DEFAULT_TOP_P

# The default of trainer_max_share: above any one honest person's share of the simulation's
# requests (at most a tenth of them), so it binds on outliers: two people sending ten times as
# much as anyone else hold 15% of a batch each (docs/RELIABILITY.md, Adversarial feedback).
DEFAULT_MAX_SHARE = 0.15


class Settings(BaseSettings):
    """Everything a tabloop process can be told.

    Invalid values fail at start with a clear message.
    """

    model_config = SettingsConfigDict(env_prefix="TABLOOP_", extra="ignore", frozen=True)

    # "prod" keeps production time constants; "sim" shrinks every window to seconds.
    profile: Literal["prod", "sim"] = "prod"
    # Where the embedded database, checkpoints and other local state live.
    data_dir: Path = Path(".tabloop")
    # SQLAlchemy URL; unset means SQLite under data_dir (embedded mode).
    database_url: str | None = None
    # Comma-separated Kafka bootstrap servers; unset means the outbox table is the event log.
    kafka_bootstrap_servers: str | None = None
    # Partitions for the topics the relay creates (keyed by user_id).
    kafka_topic_partitions: int = Field(6, ge=1, le=1024)
    kafka_replication_factor: int = Field(1, ge=1, le=16)
    # Consumer group timeouts (these values work with Tansu and Apache Kafka alike).
    kafka_session_timeout_ms: int = Field(6000, ge=1000)
    kafka_heartbeat_interval_ms: int = Field(1000, ge=100)
    # How long a trainer member may go between polls (a training step included) before the
    # group drops it. kafka-python also waits this + 5 s for the broker to answer a JoinGroup:
    # a member whose rebalance the broker never completes (seen with Tansu after a member is
    # killed) rejoins after that long, holding no partitions meanwhile.
    kafka_max_poll_interval_ms: int = Field(300_000, ge=1000)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # uvicorn worker processes for `tabloop serve`.
    workers: int = Field(1, ge=1, le=64)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # "json": one JSON object per line; "text": for a person. Unset: json for serve, relay and
    # train, text for `tabloop up` and the one-shot commands (a --log-format flag overrides).
    log_format: Literal["json", "text"] | None = None
    # Port for the Prometheus endpoint of processes without an API (`tabloop relay`, `tabloop
    # train`).
    metrics_port: int | None = Field(None, ge=1, le=65535)

    # Bounds on POST /v1/events: events per batch, body bytes (after gzip), bytes per event.
    max_events_per_batch: int = Field(1000, ge=1, le=100_000)
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1024)
    max_event_bytes: int = Field(16 * 1024, ge=256)
    # Ingestion answers 503 once this many outbox rows wait for the relay (full mode; counted
    # exactly at this size: tabloop/core/outbox.backlog).
    outbox_backlog_limit: int = Field(200_000, ge=1)
    # Seconds a client is told to wait on 429/503.
    retry_after_s: int = Field(1, ge=1, le=3600)

    # Per API key token bucket: sustained requests per second and burst size.
    rate_limit_per_s: float = Field(200.0, gt=0)
    rate_limit_burst: int = Field(400, ge=1)
    # Seconds an API process trusts a key it has just checked before asking the database again;
    # also how long a key revoked elsewhere (another worker or host, the CLI) may still work
    # there. The process that serves the revocation forgets the key at once. 0: no cache.
    auth_cache_ttl_s: float = Field(1.0, ge=0, le=2)

    # Database pool: connections, seconds to wait for one, seconds to connect.
    db_pool_size: int = Field(10, ge=1, le=500)
    db_pool_timeout_s: float = Field(2.0, gt=0)
    db_connect_timeout_s: int = Field(2, ge=1)

    # Relay: rows per round trip and idle poll interval.
    relay_batch_size: int = Field(2000, ge=1, le=100_000)
    relay_poll_interval_s: float = Field(0.05, gt=0)

    # Serving: sampling temperature and nucleus (the logged log-probs are of exactly this
    # distribution), context caps in characters, and the largest max_new_tokens allowed.
    temperature: float = Field(DEFAULT_TEMPERATURE, gt=0, le=2)
    top_p: float | None = Field(DEFAULT_TOP_P, gt=0, le=1)
    # The confidence stop: a completion ends before the first token whose log-prob is below
    # this (so it shows the part the model is sure of); -inf samples to the end of the line.
    stop_logprob: float = Field(DEFAULT_STOP_LOGPROB, le=0)
    max_prefix_chars: int = Field(4096, ge=16)
    max_suffix_chars: int = Field(1024, ge=0)
    # what the copy proposals search (tabloop.core.recall): the last this many characters of the
    # prefix, and this many of the suffix and of the snippets together; the model itself reads
    # only max_prefix_chars and max_suffix_chars of them
    max_recall_chars: int = Field(200_000, ge=0)
    # the workspace memory (tabloop/core/memory.py): how often each API process checks for
    # changed documents, and what one person's and one workspace's newest documents may fill
    memory_refresh_s: float = Field(2.0, gt=0)
    memory_person_bytes: int = Field(4_000_000, ge=0)
    memory_workspace_bytes: int = Field(64_000_000, ge=0, le=1_500_000_000)
    max_new_tokens_limit: int = Field(64, ge=1, le=256)
    # the decisions read the person and the moment (tabloop/core/person.py: their recent
    # outcomes under the key, the time since their last suggestion, the characters around the
    # cursor); off, they read nothing of them (the heads' person inputs are 0)
    person_features: bool = True
    # Threads running inference (each uses torch_threads cores); ingestion keeps its own pool.
    inference_threads: int = Field(2, ge=1, le=64)
    torch_threads: int = Field(1, ge=1, le=64)
    # Where the policy computes, for serving and the trainer's updates: auto (a CUDA GPU when
    # torch sees one, else the CPU), cpu, cuda or cuda:N. A GPU computes in bf16 autocast
    # (tabloop/core/policy/device.py).
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    # Concurrent completions of one policy share their forward passes: an inference thread
    # takes every request waiting (at most this many; 1: one at a time), after waiting at most
    # inference_batch_wait_ms for more (0: only those already queued; a lone request never
    # waits). service/completions/batching.py
    inference_batch_max: int = Field(32, ge=1, le=256)
    inference_batch_wait_ms: float = Field(0.0, ge=0, le=50)
    # How often each API process looks for a new deployment to load and swap in.
    policy_poll_interval_s: float = Field(1.0, gt=0)
    # Trainer overrides of its profile's defaults (batch size, canary size); unset: the profile's.
    trainer_batch_size: int | None = Field(None, ge=8)
    trainer_canary_min_rollouts: int | None = Field(None, ge=1)
    # The most of a training batch's weight one person (user_id) or one API key may hold: rows
    # of anyone above it are weighted down to it (trainer/caps.py). 1: no cap.
    trainer_max_share: float = Field(DEFAULT_MAX_SHARE, gt=0, le=1)
    # How the show/abstain gate learns: true, a fit on every shown verdict so far; false, the
    # policy gradient alone; unset: the profile's (sim: the fit; prod: the policy gradient).
    trainer_gate_fit: bool | None = None
    # Whether the lines head is set by a fit on how much of each copy's next lines the person
    # went on to write (trainer/blocks.py); false: the policy gradient alone moves it.
    trainer_lines_fit: bool = True
    # Processes one policy-gradient update runs on (data-parallel over torch.distributed, gloo;
    # each with torch_threads threads): `tabloop train --nproc N`. 1: the trainer's own.
    trainer_nproc: int = Field(1, ge=1, le=64)
    # The trainers' Kafka consumer group: every `tabloop train` of one deployment joins it and
    # joins the people of its share of the partitions (embedded: the name of the log offset).
    trainer_group: str = Field("tabloop-trainer", min_length=1, max_length=90)
    # Where `tabloop train` reaches the API, and its deploy-scoped key (tabloop up makes its own).
    trainer_api_url: str | None = None
    trainer_api_key: str | None = None
    # Largest checkpoint file accepted by POST /admin/policies.
    max_checkpoint_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # The pretrained policy registered and made live on first start (shipped with the code).
    base_checkpoint: Path = Path(__file__).resolve().parent / "policy" / "base"
    # A Hugging Face causal LM's directory (safetensors, tokenizer.json) to serve and train
    # instead: imported on first start as the base policy, with a fresh LoRA adapter
    # (docs/MODEL.md, Bring your model). Needs `pip install 'tabloop[hf]'`.
    base_model: Path | None = None
    # Days code text is kept (rollouts' context and suggestion, settled text, their outbox
    # copies); then it is blanked and the rows, rewards and counts stay. Unset: kept until the
    # person is purged. At least 1 day, and never shorter than twice the reward horizon
    # (docs/PRIVACY.md).
    code_retention_days: int | None = Field(None, le=36_500)

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is None or v == "":
            return None
        if not v.startswith(("sqlite", "postgresql")):
            raise ValueError("must be a sqlite:// or postgresql:// URL")
        if v.startswith("postgresql://"):  # psycopg 3 is the driver we ship
            v = "postgresql+psycopg://" + v.removeprefix("postgresql://")
        return v

    @field_validator("code_retention_days")
    @classmethod
    def _check_retention(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(
                "must be at least 1 (day): the trainer reads a rollout's code until its reward "
                "is final and its batch is built; unset it to keep code until a purge"
            )
        return v

    @field_validator("kafka_bootstrap_servers")
    @classmethod
    def _check_bootstrap(cls, v: str | None) -> str | None:
        if v is None or v.strip() == "":
            return None
        for server in v.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"expected host:port[,host:port...], got {server!r}")
        return v

    @model_validator(mode="after")
    def _check_mode(self) -> Settings:
        if self.kafka_bootstrap_servers is None and self.db_url.startswith("postgresql"):
            # The outbox-as-log reader relies on SQLite's serialized commits for gapless offsets.
            raise ValueError(
                "PostgreSQL needs a broker: set TABLOOP_KAFKA_BOOTSTRAP_SERVERS, "
                "or unset TABLOOP_DATABASE_URL for the embedded SQLite mode"
            )
        if self.kafka_heartbeat_interval_ms * 3 > self.kafka_session_timeout_ms:
            raise ValueError(
                "kafka_heartbeat_interval_ms must be at most a third of the session timeout"
            )
        return self

    @property
    def db_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'tabloop.db').resolve()}"

    @property
    def embedded(self) -> bool:
        """True when the outbox table is the event log (no broker)."""
        return self.kafka_bootstrap_servers is None

    @property
    def is_sqlite(self) -> bool:
        return self.db_url.startswith("sqlite")


def load_settings(**overrides: object) -> Settings:
    """Build the settings, turning validation errors into one readable message."""
    from pydantic import ValidationError

    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as e:
        lines = []
        for err in e.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            name = f"TABLOOP_{field.upper()}" if field != "settings" else field
            lines.append(f"  {name}: {err['msg']}")
        raise SystemExit("invalid tabloop settings:\n" + "\n".join(lines)) from None
