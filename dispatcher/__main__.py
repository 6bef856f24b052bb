"""``python -m dispatcher``: not built yet (issue #3); says so instead of pretending."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    print("the dispatcher daemon is not built yet (issue #3)", file=sys.stderr)
    sys.exit(2)
