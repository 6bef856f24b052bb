"""Reading a daemon's /metrics over HTTP, parsed as Prometheus parses it."""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""Every sample of one scrape as (name, labels) -> value."""


def scrape(port: int | None) -> Samples:
    """One scrape of ``/metrics`` on a local port ({} while the daemon serves none yet)."""
    if port is None:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample with exactly these labels, None when it is not exported."""
    return samples.get((name, frozenset(labels.items())))


def labelled(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every sample of ``name``, by its labels."""
    return {labels: found for (sample, labels), found in samples.items() if sample == name}


def label_sets(samples: Samples, name: str, *keys: str) -> set[tuple[str, ...]]:
    """The values of ``keys`` in every sample of ``name``."""
    found = set()
    for labels in labelled(samples, name):
        pairs: Mapping[str, str] = dict(labels)
        found.add(tuple(pairs[key] for key in keys))
    return found
