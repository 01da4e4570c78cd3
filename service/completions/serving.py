"""Serving policies: load the deployed versions, route users to them, swap atomically.

Each API process follows the registry: a background thread polls the deployment timeline,
loads any new version (from its local cache or the database, hash-verified) and then replaces
the routing table in one assignment. A request keeps the policy object it was routed to, so
requests in flight finish on the old version while new ones get the new routing.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
from dataclasses import dataclass, field

import sqlalchemy as sa
import torch

from service.errors import Unavailable
from tabloop.core.config import Settings
from tabloop.core.db import blob_transaction
from tabloop.core.policy.checkpoint import CheckpointError, load_checkpoint
from tabloop.core.policy.device import resolve
from tabloop.core.policy.languages import DEFAULT_LANGUAGES
from tabloop.core.policy.model import GPT
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.registry import Deployment, artifact_files, current_deployment, write_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedPolicy:
    version: int
    model: GPT
    tokenizer: CodeTokenizer
    # what its base was pretrained on (the manifest's): requests in other languages abstain
    languages: frozenset[str] = field(default_factory=lambda: frozenset(DEFAULT_LANGUAGES))


@dataclass(frozen=True)
class Routing:
    deployment_id: int
    live: LoadedPolicy
    canary: LoadedPolicy | None
    canary_fraction: float


def user_bucket(user_id: str, salt: int) -> float:
    """A stable point in [0, 1) per (user, canary version): the same users stay on a canary
    for its whole life, and each canary draws its own users."""
    digest = hashlib.sha256(f"{salt}:{user_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose(routing: Routing, user_id: str) -> LoadedPolicy:
    if (
        routing.canary is not None
        and user_bucket(user_id, routing.canary.version) < routing.canary_fraction
    ):
        return routing.canary
    return routing.live


class PolicyServer:
    def __init__(self, settings: Settings, engine: sa.Engine) -> None:
        self.settings, self.engine = settings, engine
        self.device = resolve(settings.device)  # where loaded policies compute
        self.cache_dir = settings.data_dir / "policies"
        self.routing: Routing | None = None
        self._loaded: dict[int, LoadedPolicy] = {}
        self._failed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tabloop-policies", daemon=True)

    def route(self, user_id: str) -> LoadedPolicy:
        routing = self.routing
        if routing is None:
            raise Unavailable("no policy is deployed yet", headers={"Retry-After": "5"})
        return choose(routing, user_id)

    def refresh(self) -> bool:
        """Load what the current deployment needs and swap it in; True if routing changed."""
        with self.engine.connect() as conn:
            dep = current_deployment(conn)
        if dep is None or (self.routing is not None and self.routing.deployment_id == dep.id):
            return False
        live = self._load(dep.live_version)
        canary = self._load(dep.canary_version) if dep.canary_version is not None else None
        if live is None:
            return False
        self.routing = Routing(dep.id, live, canary, dep.canary_fraction if canary else 0.0)
        keep = {live.version} | ({canary.version} if canary else set())
        self._loaded = {v: p for v, p in self._loaded.items() if v in keep}
        self._log_swap(dep, canary)
        return True

    def _log_swap(self, dep: Deployment, canary: LoadedPolicy | None) -> None:
        if canary is None:
            log.info("serving policy v%d (deployment %d, %s)", dep.live_version, dep.id, dep.action)
        else:
            log.info(
                "serving policy v%d, canary v%d for %.0f%% of users (deployment %d)",
                dep.live_version,
                canary.version,
                100 * dep.canary_fraction,
                dep.id,
            )

    def _load(self, version: int) -> LoadedPolicy | None:
        if version in self._loaded:
            return self._loaded[version]
        if version in self._failed:
            return None
        directory = self.cache_dir / f"v{version}"
        try:
            try:
                model, tokenizer, manifest = load_checkpoint(directory)
            except CheckpointError:  # not cached yet (or a damaged cache): fetch from the registry
                with blob_transaction(self.engine) as conn:
                    files = artifact_files(conn, version)
                tmp = directory.with_name(directory.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                write_files(tmp, files)
                shutil.rmtree(directory, ignore_errors=True)
                tmp.rename(directory)
                model, tokenizer, manifest = load_checkpoint(directory)
        except (CheckpointError, KeyError, OSError) as e:
            log.error("cannot load policy v%d, keeping the current routing: %s", version, e)
            self._failed.add(version)
            return None
        model.requires_grad_(False)
        model.to(self.device)
        policy = LoadedPolicy(version, model, tokenizer, frozenset(manifest.languages))
        self._loaded[version] = policy
        return policy

    def start(self) -> None:
        torch.set_num_threads(self.settings.torch_threads)
        try:
            self.refresh()
        except sa.exc.SQLAlchemyError as e:
            log.warning("policy registry unavailable at start: %s", str(e).split("\n")[0])
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.settings.policy_poll_interval_s):
            try:
                self.refresh()
            except sa.exc.SQLAlchemyError as e:
                log.warning("policy registry unavailable: %s", str(e).split("\n")[0])

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
