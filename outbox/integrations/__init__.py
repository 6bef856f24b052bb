"""Adapters that serve a :class:`~outbox.Registry` to agent frameworks.

Each adapter lives in a module of its own and needs its framework as an extra
(``pip install 'effect-outbox[pydantic-ai]'`` for :mod:`outbox.integrations.pydantic_ai`);
nothing here imports a framework until its module is imported.
"""

from __future__ import annotations
