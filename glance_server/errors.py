"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """An error answered to the client as is."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> APIError:
    return APIError(400, message, code, param)


def body_parse_error(raw: bytes | None) -> APIError:
    """Why a JSON request body could not be parsed: not UTF-8, nested too deeply, or not JSON (400)."""
    import json

    if raw is None:
        return bad_request("the request body could not be parsed as JSON", "invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return bad_request(f"the request body is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                           "invalid_utf8")
    try:
        json.loads(text)
    except RecursionError:
        return bad_request("the request body's JSON is nested too deeply", "json_too_deep")
    except ValueError as exc:
        return bad_request(f"the request body is not valid JSON ({exc})", "invalid_json")
    return bad_request("the request body could not be parsed as JSON", "invalid_json")
