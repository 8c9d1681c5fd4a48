"""Record stores: ``base`` defines the interface; one module per backend."""

from __future__ import annotations

from idemproxy.config import StorageConfig
from idemproxy.metrics import Metrics
from idemproxy.store.base import Claim, Health, Record, State, Store, StoredResponse

__all__ = ["Claim", "Health", "Record", "State", "Store", "StoredResponse", "build_store"]


def build_store(config: StorageConfig, metrics: Metrics | None = None) -> Store:
    """PostgreSQL (with Redis in front when configured), or the embedded file when neither is named."""
    if config.postgres is None:
        from idemproxy.store.embedded import EmbeddedStore

        return EmbeddedStore(config.embedded, metrics)
    from idemproxy.store.postgres import PostgresStore

    # Without Redis, PostgreSQL's LISTEN/NOTIFY wakes requests waiting in `in_flight: wait` mode.
    durable = PostgresStore(config.postgres, metrics, listen=config.redis is None)
    if config.redis is None:
        return durable
    from idemproxy.store.redis import RedisFrontedStore

    return RedisFrontedStore(durable, config.redis, metrics)
