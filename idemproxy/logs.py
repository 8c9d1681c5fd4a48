"""Logging set-up: plain text for people, JSON lines for machines."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from idemproxy.config import LogConfig

# Attributes every LogRecord has; anything else was passed in `extra` and belongs in the JSON line.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def _one_line(record: logging.LogRecord) -> bool:
    """asyncpg's pool logs a traceback each time it cannot refill its minimum of connections while PostgreSQL is
    away (a restart, a connection limit); our own lines already say the store is down. Keep its line, with the
    error's type and message, and drop the traceback."""
    if record.exc_info and record.exc_info[1] is not None:
        try:  # (a filter runs outside logging's own error handling: never raise into asyncpg's pool)
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(error).__name__}: {error})"
        except Exception:  # the record is then logged as it came, traceback and all
            return True
        record.args = None
        record.exc_info = None
        record.exc_text = None
    return True


def setup_logging(config: LogConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.CRITICAL + 1 if config.level == "OFF" else config.level)
    for noisy in ("aiohttp.access",):  # our own access line replaces aiohttp's
        logging.getLogger(noisy).setLevel(logging.WARNING)
    pool = logging.getLogger("asyncpg.pool")
    if _one_line not in pool.filters:
        pool.addFilter(_one_line)
