"""Helpers shared by the test suite (and the benchmarks)."""

from __future__ import annotations
