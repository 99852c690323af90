"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.bodies import ErrorDetail, ErrorResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    detail = ErrorDetail(message=message, type=_TYPES.get(status, "Error"), param=param, code=status)
    return ErrorResponse(error=detail).to_json()


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def param_of(error: Exception) -> str | None:
    """The parameter a ValueError is about, where the code that raised it named it (InvalidParameterError);
    never guessed from the message."""
    return getattr(error, "param", None)
