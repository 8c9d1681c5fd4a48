"""Record stores: ``base`` defines the interface; one module per backend."""

from __future__ import annotations

import logging

from idemproxy.config import StorageConfig
from idemproxy.metrics import Metrics
from idemproxy.store.base import Claim, Health, Record, State, Store, StoredResponse
from idemproxy.store.codec import Codec

__all__ = ["Claim", "Health", "Record", "State", "Store", "StoredResponse", "build_store"]

log = logging.getLogger("idemproxy.store")


def build_store(
    config: StorageConfig, metrics: Metrics | None = None, *, max_body: int = 1024 * 1024,
    wait_for_postgres: bool = False,
) -> Store:
    """PostgreSQL (with Redis in front when configured), or the embedded file when neither is named.

    ``max_body`` is the largest response body any route stores: reading a compressed value back stops there.
    ``wait_for_postgres``: a PostgreSQL server still unreachable after ``open()``'s attempts does not fail it; the
    store opens once the server answers, and until then every operation is ``StoreUnavailable`` (a serving proxy:
    CONTRACT "Health", a store outage does not take the replica out of service).
    """
    codec = Codec.from_config(config, max_body=max_body, metrics=metrics)
    if config.compression is not None or config.encryption is not None:
        log.info("%s", codec.describe())
    if config.postgres is None:
        from idemproxy.store.embedded import EmbeddedStore

        return EmbeddedStore(config.embedded, metrics, codec=codec)
    from idemproxy.store.postgres import PostgresStore

    # Without Redis, PostgreSQL's LISTEN/NOTIFY wakes requests waiting in `in_flight: wait` mode.
    durable = PostgresStore(config.postgres, metrics, listen=config.redis is None, codec=codec,
                            wait_for_server=wait_for_postgres)
    if config.redis is None:
        return durable
    from idemproxy.store.redis import RedisFrontedStore

    return RedisFrontedStore(durable, config.redis, metrics, codec=codec)
