"""uvicorn's HTTP/1.1 protocol with a deadline on request headers.

uvicorn closes idle keep-alive connections, but a client that trickles its request
headers one byte at a time (slowloris) holds a connection forever: any byte cancels the
keep-alive timer and nothing else watches. This protocol gives every request's headers
`header_timeout_s` from the moment the connection opens (or the previous response ended).
When they are not complete by then: a request begun (some of its bytes came) gets a 408
with the OpenAI error body and the connection is closed; a connection on which nothing
came (idle, or an idle keep-alive) is closed without a response, as uvicorn's keep-alive
timeout does (there is no request to answer). Bodies and slow readers are timed out by
the app (app.py), which sees them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete
            self._disarm()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        partial, _ = self.conn.trailing_data  # bytes of a request not yet complete
        if partial:
            self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the request headers did not arrive within {timeout_s:g}s",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


def guarded_protocol(header_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this header deadline."""
    return type("GuardedH11", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})
