"""``outbox console``: the operator's web pages, served by the package (extra ``console``).

What ``outbox ops``, ``outbox approvals``, ``outbox stats`` and ``outbox dlq`` do, in
a browser: the same store operations, the same guarded transitions and fencing, as the
least-privileged ``outbox_operator`` role. Nothing here is imported by ``outbox`` itself:
:mod:`outbox.console.cli` registers the subcommand without the web stack, and the
pages (:mod:`outbox.console.app`) load only when the console starts.
"""
