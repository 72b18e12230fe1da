"""The one error type of the HTTP layer: a status, a message naming the bad item, OpenAI's error shape."""

from __future__ import annotations

SHUTTING_DOWN = "the server is shutting down; retry the request"  # (503 server_shutting_down)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
