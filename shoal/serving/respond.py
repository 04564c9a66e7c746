"""Answering a generation: a JSON body once every choice ended (cancelled if the client
leaves first), or an SSE stream of chunks that always ends with `data: [DONE]` (an error
becomes an error event first); and the error responses in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shoal.serving.admission import QueueFull
from shoal.serving.generation import EngineStopped, Generation
from shoal.serving.errors import ApiError
from shoal.serving.responses import ResponseFormat

log = logging.getLogger(__name__)


async def respond(gen: Generation, fmt: ResponseFormat, stream: bool, include_usage: bool,
                   request: Request) -> Response:
    if stream:
        return StreamingResponse(_events(gen, fmt, include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    task = asyncio.ensure_future(_collect(gen, fmt))
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client went away (or this task was cancelled)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        watch.cancel()
    if task.cancelled():
        return Response(status_code=499)
    return JSONResponse(task.result())  # raises the ApiError / EngineStopped

async def _collect(gen: Generation, fmt: ResponseFormat) -> dict:
    texts = {c.index: [] for c in gen.choices}
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for d in deltas:
            texts[d.choice.index].append(d.text)
    return fmt.response([(c, "".join(texts[c.index])) for c in gen.choices], gen.usage())

async def _events(gen: Generation, fmt: ResponseFormat, include_usage: bool):
    try:
        for c in gen.choices:
            first = fmt.first_chunk(c)
            if first is not None:
                yield sse(first)
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for d in deltas:
                chunk = fmt.chunk(d)
                if chunk is not None:
                    yield sse(chunk)
        if include_usage:
            yield sse(fmt.usage_chunk(gen.usage()))
    except ApiError as e:
        yield sse(e.body())
    except EngineStopped as e:
        yield sse(engine_stopped(e).body())
    except Exception as e:  # never a half-open stream without a word
        log.exception("stream failed")
        yield sse(ApiError(500, f"{type(e).__name__}: {e}", type_="server_error").body())
    yield "data: [DONE]\n\n"


async def disconnected(request: Request) -> None:
    """Returns once the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def engine_stopped(error: BaseException) -> ApiError:
    return ApiError(503, f"the engine has stopped: {error}", type_="service_unavailable",
                    code="engine_stopped")


def error_response(e: ApiError) -> JSONResponse:
    headers = ({"Retry-After": str(e.retry_after_s)} if isinstance(e, QueueFull) else None)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)
