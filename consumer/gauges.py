"""The consumer's gauges of what waits to be executed, read from Postgres on a loop of
their own beside the deliveries and the reconciler: a consumer cut off from the broker
(when ready operations wait longest) still reports them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from consumer.database import Database
from consumer.telemetry import log_refresh_failed
from outbox import store
from outbox.metrics import ConsumerMetrics
from outbox.signals import Stoppable

REFRESH_SECONDS = 5.0


class ExecutionGauges(Stoppable):
    """The age of the oldest operation ready to execute, the approvals waiting, and the
    operations each provider holds back."""

    def __init__(
        self,
        metrics: ConsumerMetrics,
        database: Database,
        *,
        every: float = REFRESH_SECONDS,
        providers: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__()
        self.metrics = metrics
        self.database = database
        self.every = every
        self.providers = dict(providers or {})
        """Each provider's tools, whose waiting operations its gauge counts."""

    async def refresh(self) -> store.ExecutionBacklog:
        backlog = await self.database.run(store.execution_gauges())
        self.metrics.oldest_ready_age.set(backlog.oldest_ready_age_seconds)
        self.metrics.awaiting_approval.set(backlog.awaiting_approval)
        if self.providers:
            waiting = await self.database.run(store.waiting_operations_by_tool())
            for provider, tools in self.providers.items():
                self.metrics.provider_waiting.labels(provider).set(
                    sum(waiting.get(tool, 0) for tool in tools)
                )
        return backlog

    async def run(self) -> None:
        """Refresh until :meth:`stop`. A failed read leaves the last values in place (an
        outage of the database is what the deliveries' retry_later shows) and is tried
        again at the next turn; nothing ends the loop but the stop."""
        while not self.stopping:
            try:
                await self.refresh()
            except Exception as error:
                log_refresh_failed(
                    error,
                    "consumer.gauges_failed",
                    "reading the execution gauges failed; the next turn retries",
                )
            await self._sleep(self.every)
