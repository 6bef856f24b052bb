"""``python -m consumer``: the same as ``outbox consumer``."""

from __future__ import annotations

from consumer.cli import main

if __name__ == "__main__":
    main()
