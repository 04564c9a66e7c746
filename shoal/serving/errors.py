"""Errors in OpenAI's shape: `ApiError` (answered as {"error": {"message", "type", "param",
"code"}}), the 400 of a bad field, and pydantic's refusals turned into 400s naming the
field (the server never answers 422)."""

from __future__ import annotations

import json
import re


class ApiError(Exception):
    """An error answered in OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)

    def body(self) -> dict:
        # a message quoting the request's text stays encodable (a lone surrogate escaped)
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def field_of(message: str) -> str | None:
    """The request field a SamplingParams message names ("SamplingParams.top_p must...")."""
    m = re.search(r"SamplingParams\.(\w+)", message)
    return m.group(1) if m else None


def validation_error(errors: list[dict]) -> ApiError:
    """A 400 for what pydantic refused (FastAPI would answer 422): the first error, with
    its location as the param ("messages.0.role")."""
    if not errors:
        return bad_request("invalid request body")
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # a union (prompt: str | list[int] | ...) reports one error per member: name the field
    loc = [x for x in loc if not re.match(r"^(str|list|int|float|bool)\b", x)]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {e.get('msg')}")
    what = param or "the body"  # the body itself (not a JSON object, say)
    if e.get("type") == "missing":
        return bad_request(f"{what} is required", param)
    msg = str(e.get("msg", "")).removeprefix("Value error, ")
    try:  # the value as the client wrote it (JSON), not as Python prints it
        shown = json.dumps(e.get("input"), ensure_ascii=False)
    except (TypeError, ValueError):
        shown = repr(e.get("input"))
    return bad_request(f"{what}: {msg} (got {shown:.80})", param)
