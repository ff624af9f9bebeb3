"""uvicorn's HTTP protocol (h11) with a deadline for a request's headers."""
from __future__ import annotations


def header_timeout_protocol(seconds: float):
    """uvicorn's HTTP protocol with a deadline for headers: from the moment a connection waits for
    a request (opened, or done with its last response) it has `seconds` to deliver the request's
    headers, else it is closed. uvicorn's own keep-alive timeout ends idle connections only after
    a first response, and stops the moment a byte arrives: a client sending nothing, or a header
    byte a second, held its connection for good."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self._deadline is None:
                self._deadline = self.loop.call_later(seconds, self._expire)
            elif not waiting and self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
