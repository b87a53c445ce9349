"""OpenAI's error bodies and the request-body limit below FastAPI (:class:`BodyLimit`) of ``rlcore serve``."""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse


# ------------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An error answered with OpenAI's error body (and ``headers``, e.g. ``Retry-After``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def error_bytes(status: int, message: str, code: str) -> bytes:
    """The body of :func:`error_response` as bytes, for an answer sent below FastAPI (:class:`BodyLimit`)."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": code}}).body


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 before the app reads it, by its
    Content-Length (a body of up to :attr:`drain_bytes` more is read and dropped first; a larger one is not waited
    for), or (chunked, no length) as soon as the bytes received pass the limit; so no request holds
    more than ``max_bytes`` of body in memory. A body still arriving after ``timeout_s`` is answered 408. The body
    read is handed on to the app unchanged."""

    drain_bytes = 1 << 20
    """Bytes of an oversized body read and dropped before the 413, so the client reads the answer (beyond: closed)."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            what = f"{int(length)} bytes" if length.isdigit() else f"Content-Length {length[:20]!r}"
            if length.isdigit() and int(length) <= self.max_bytes + self.drain_bytes:
                # a body the client may already be sending (the official clients send it with the headers): read
                # and dropped first, else the close resets the connection before the client reads the 413
                try:
                    if await asyncio.wait_for(self._read(receive), self.timeout_s) is None:
                        return  # the client went away
                except TimeoutError:
                    pass
            return await self._refuse(send, 413, f"The request body is too large: {what}; this server takes at most "
                                                 f"{self.max_bytes} (--max-body-bytes)", "request_too_large")
        try:  # (a timeout scope, not wait_for: no task of its own per request)
            async with asyncio.timeout(self.timeout_s):
                read = await self._read(receive)
        except TimeoutError:
            return await self._refuse(send, 408, f"The request body did not arrive within --request-timeout "
                                                 f"{self.timeout_s:g} s", "timeout")
        if read is None:  # the client went away
            return
        body, size = read
        if size > self.max_bytes:
            return await self._refuse(send, 413, f"The request body is too large: more than {self.max_bytes} bytes, "
                                                 "the most this server takes (--max-body-bytes)", "request_too_large")
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive) -> tuple[bytes, int] | None:
        """The body and its size in bytes, keeping no more than ``max_bytes`` of it (a longer one: the rest is read
        and dropped, up to :attr:`drain_bytes`, and the bytes kept are not the body); None if the client left.

        The rest of an oversized body is drained before the 413 rather than left unread: a socket closed with
        unread bytes is reset (RST), and the client, still sending, would see "connection reset" instead of the
        answer (the lingering close of nginx, Go's net/http)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_bytes + self.drain_bytes:
                return b"".join(chunks), size

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str) -> None:
        body = error_bytes(status, message, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
