"""``python -m outbox``: the ``outbox`` command, for hosts (MCP clients, supervisors)
that start a module rather than a console script."""

from __future__ import annotations

from outbox.cli import main

if __name__ == "__main__":
    main()
