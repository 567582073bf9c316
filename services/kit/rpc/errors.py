"""Errors a servicer raises to answer with a specific gRPC status.

The kit's interceptor maps a ServiceError to its status code and message; anything else
becomes INTERNAL with a log line carrying the trace id. Messages should name the field and
say what was wrong, e.g. InvalidArgument("sampling.temperature: must be >= 0, got -1").
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base: carries the gRPC status code to answer with."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.retry_after_s is None:
            return ()
        return (("retry-after-ms", str(int(self.retry_after_s * 1000))),)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Aborted(ServiceError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED
