"""Summarize a py-spy ``--format raw`` profile (collapsed stacks, one ``stack count``
per line): where the samples are, by the function at the top of the stack and by the
package that function lives in. ``python -m bench.e2e --py-spy DIR`` writes one file per daemon.

    .venv/bin/python -m bench.spy_summary DIR/*.txt --top 15
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from outbox.cli import positive_int

# A frame reads "function (path/to/module.py:line)"; py-spy may leave the line out.
_FRAME = re.compile(r"^(?P<function>.*?) \((?P<path>[^():]+)(?::\d+)?\)$")
# py-spy names a frame's file from its package root (``psycopg/cursor.py``) or by its
# full path; either way the package is the component before the file.
_ALIASES = {"aio_pika": "aio-pika", "psycopg_pool": "psycopg", "prometheus_client": "prometheus"}


def package_of(path: str) -> str:
    parts = [part for part in path.split("/") if part]
    if len(parts) < 2:
        return "other"
    package = parts[-2]
    for part in parts:
        # The first known top-level name wins over a subpackage (pydantic/_internal).
        if part in (
            "outbox",
            "consumer",
            "dispatcher",
            "aiormq",
            "aio_pika",
            "pamqp",
            "psycopg",
            "psycopg_pool",
            "sqlalchemy",
            "pydantic",
            "pydantic_core",
            "asyncio",
            "logging",
            "json",
            "prometheus_client",
            "uvloop",
            "tenacity",
        ):
            package = part
            break
    return _ALIASES.get(package, package)


def summarize(lines: list[str]) -> tuple[int, Counter[str], Counter[str]]:
    """(samples, samples by top function, samples by top frame's package)."""
    total = 0
    by_function: Counter[str] = Counter()
    by_package: Counter[str] = Counter()
    for line in lines:
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        top = stack.split(";")[-1]
        found = _FRAME.match(top)
        function, path = (found["function"], found["path"]) if found else (top, "")
        by_function[f"{function} ({Path(path).name})" if path else function] += count
        by_package[package_of(path)] += count
    return total, by_function, by_package


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--top", type=positive_int, default=12)
    args = parser.parse_args()
    for profile in args.profiles:
        total, by_function, by_package = summarize(profile.read_text().splitlines())
        print(f"== {profile.name}: {total} samples")
        if not total:
            continue
        packages = ", ".join(
            f"{name} {100 * n / total:.1f}%" for name, n in by_package.most_common()
        )
        print(f"by package: {packages}")
        for function, n in by_function.most_common(args.top):
            print(f"  {100 * n / total:5.1f}%  {function}")


if __name__ == "__main__":
    main()
