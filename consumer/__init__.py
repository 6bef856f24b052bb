"""The consumer daemon. It imports only from `outbox`, never from its sibling daemon."""

from __future__ import annotations
