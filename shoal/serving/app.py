"""The FastAPI app of `shoal serve`: routes over an `OpenAIServer`, the API key check, the
body limit, and every error answered in OpenAI's shape."""

from __future__ import annotations

import asyncio
import hmac
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.serving.body_limit import BodyLimit
from shoal.version import __version__
from shoal.serving.generation import EngineStopped
from shoal.serving.http import OpenAIServer
from shoal.serving.errors import ApiError, validation_error
from shoal.serving.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                           DetokenizeRequest, TokenizeRequest)
from shoal.serving.respond import engine_stopped, error_response


def build_app(server: OpenAIServer, api_key: str | None = None) -> FastAPI:
    """The app; with `api_key`, every /v1/* request must carry `Authorization: Bearer
    <api_key>` (compared in constant time) or is answered 401 (as vLLM: /health,
    /version and /metrics stay open). A body past the server's `max_body_bytes` is
    answered 413 before it is parsed (body_limit.py)."""
    app = FastAPI(title="shoal", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=server.limits.max_body_bytes)

    if api_key:
        expected = api_key.encode()

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            if request.url.path.startswith("/v1/"):
                scheme, _, token = request.headers.get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(
                        token.strip().encode("utf-8", "replace"), expected):
                    return error_response(ApiError(
                        401, "Missing or incorrect API key: send 'Authorization: Bearer "
                        "<key>' with the key the server was started with (--api-key)",
                        code="invalid_api_key"))
            return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e)

    @app.exception_handler(EngineStopped)
    async def on_engine_stopped(request: Request, e: EngineStopped):
        return error_response(engine_stopped(e))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        return error_response(validation_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(e.status_code, str(e.detail), type_=kind))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await server.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await server.detokenize(body)

    @app.get("/health")
    async def health():
        return server.health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return await server.render_metrics()

    if os.environ.get("SHOAL_SERVE_DEBUG") == "1":  # for tests: never on by default
        @app.get("/debug/integrity")
        async def integrity():
            """Block accounting on every rank (Scheduler.check_integrity)."""
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(server._submitter, server.llm.check_integrity)
            except AssertionError as e:
                return error_response(ApiError(500, str(e), type_="server_error"))
            return {"ok": True}

        @app.get("/debug/idle")
        async def idle(timeout: float = 30.0):
            """Waits (at most `timeout` seconds) until the engine has no work: a test's
            signal that abandoned requests were cancelled and their blocks freed."""
            loop = asyncio.get_running_loop()
            try:
                is_idle = await loop.run_in_executor(server._submitter, server.wait_idle, timeout)
            except Exception as e:  # the engine stopped for good: wait_idle raises its error
                return error_response(engine_stopped(e))
            return {"idle": is_idle}

    return app
