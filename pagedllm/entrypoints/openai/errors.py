"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def param_of(message: str) -> str | None:
    """Our ValueErrors start with the parameter's name ("top_p must be in (0, 1], got 2.0.")."""
    first = message.split(" ", 1)[0]
    return first if first.isidentifier() else None
