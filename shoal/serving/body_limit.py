"""A cap on request bodies, applied before anything parses them (`--max-body-bytes`).

An ASGI middleware in front of the app: a body whose Content-Length is past the cap is
answered 413 at once, unread; a body without one (chunked) is read up to the cap and
answered 413 as soon as it passes it. Nothing past the cap is ever held in memory, parsed
as JSON or tokenized, so an oversized request costs the server next to nothing and
delays no other request.
"""

from __future__ import annotations

import json

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128k-token prompt as token ids in JSON is ~1 MB


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, int(declared))
        if declared is not None:  # the server holds the body to its declared length
            return await self.app(scope, receive, send)
        body, more = [], True  # chunked: read it here, within the cap, then hand it on
        size = 0
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return await self.app(scope, _replay([], message), send)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send, size)
            body.append(message)
            more = message.get("more_body", False)
        return await self.app(scope, _replay(body, None, receive), send)

    async def _refuse(self, send, size: int) -> None:
        payload = json.dumps({"error": {
            "message": f"the request body is larger than this server takes: {size} bytes "
                       f"or more, at most {self.max_bytes} (--max-body-bytes)",
            "type": "invalid_request_error", "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list, last, receive=None):
    """A `receive` that gives these messages, then `last` (or what `receive` gives)."""
    queue = list(messages)

    async def replay():
        if queue:
            return queue.pop(0)
        if last is not None:
            return last
        return await receive()
    return replay
