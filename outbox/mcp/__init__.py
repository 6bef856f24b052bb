"""``outbox mcp``: the tool registry as MCP tools, with the guarantee.

Shaped like :mod:`outbox.console`: :mod:`outbox.mcp.cli` is the subcommand and
:mod:`outbox.mcp.config` its settings (both import nothing of the optional ``mcp`` SDK,
so without the ``mcp`` extra every other command keeps working and this one says what
to install); :mod:`outbox.mcp.server` answers calls, :mod:`outbox.mcp.tools` lists the
tools, :mod:`outbox.mcp.answers` says what the model reads, and
:mod:`outbox.mcp.transports` serves stdio or streamable HTTP.

Nothing is imported here, so that loading the subcommand loads no SDK.
"""
