"""``python -m consumer``: not built yet (issue #4); says so instead of pretending."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    print("the consumer daemon is not built yet (issue #4)", file=sys.stderr)
    sys.exit(2)
