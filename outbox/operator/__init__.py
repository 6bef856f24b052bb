"""The operator's side, one set of commands for every front end.

- :mod:`outbox.operator.rules`: what an operator may do to an operation (the resolution
  vocabulary, which resolutions an operation allows, the approval and resolution
  writes); ``outbox ops``/``outbox approvals`` and the console both call it.
- :mod:`outbox.operator.render`: how the records read, as text and as JSON.
- :mod:`outbox.operator.commands`: ``outbox ops``, ``outbox approvals``, ``outbox stats``,
  ``outbox providers``.
- :mod:`outbox.operator.dlq`: the dead-letter queue, for ``outbox dlq`` and the console;
  :mod:`outbox.operator.dlq_commands`: ``outbox dlq list`` and ``outbox dlq requeue``.
- :mod:`outbox.operator.callbacks_commands`: ``outbox callbacks list``.

Every command here imports the shared flags and how a command runs from the leaves
:mod:`outbox.cli.arguments` and :mod:`outbox.cli.run`, never :mod:`outbox.cli` itself,
which builds the ``outbox`` parser from these modules.
"""
