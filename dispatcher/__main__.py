"""``python -m dispatcher``: the same as ``outbox dispatcher``."""

from __future__ import annotations

from dispatcher.cli import main

if __name__ == "__main__":
    main()
