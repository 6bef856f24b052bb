"""What the serving layer takes from uvicorn's internals (outbox/serving/protocol.py): if
an upgrade renames or drops one, this fails before a front end silently loses its head
deadline or its cap."""

from __future__ import annotations

import inspect

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from outbox.serving import Limits
from outbox.serving.protocol import BoundedProtocol, protocol_for

LIMITS = Limits(max_body=1024, header_seconds=1, body_seconds=1, max_connections=2, grace_seconds=1)


def test_uvicorn_still_has_what_the_protocol_overrides_and_reads() -> None:
    for method in ("connection_made", "data_received", "on_response_complete", "connection_lost"):
        assert callable(getattr(H11Protocol, method)), method
    init = inspect.getsource(H11Protocol.__init__)
    for attribute in ("self.connections", "self.cycle", "self.transport", "self.loop"):
        assert attribute in init, attribute
    assert "self.response_complete" in inspect.getsource(RequestResponseCycle.__init__)
    # on_response_complete is what the cycle calls when a response is sent.
    assert "on_response" in inspect.signature(RequestResponseCycle.__init__).parameters


def test_uvicorn_takes_the_protocol_class_as_given() -> None:
    protocol = protocol_for(LIMITS, "test")
    config = uvicorn.Config(lambda scope, receive, send: None, http=protocol, ws="none")
    config.load()

    assert config.http_protocol_class is protocol
    assert issubclass(protocol, BoundedProtocol)
    assert protocol.limits is LIMITS
    assert config.ws_protocol_class is None
