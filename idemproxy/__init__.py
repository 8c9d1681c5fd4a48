"""idemproxy: Idempotency-Key semantics in front of any HTTP API."""

__version__ = "0.1.0"
