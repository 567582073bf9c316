"""Errors raised while staging a weight version on a receiver.

Each is a ValueError (library users can catch it plainly) and a kit ServiceError, so a servicer
that lets one escape answers with the right gRPC status: a malformed slice is INVALID_ARGUMENT,
a version that is not newer than the serving one (or a commit of an incomplete version) is
FAILED_PRECONDITION, and bytes that do not match their checksum are DATA_LOSS.
"""

from __future__ import annotations

import grpc

from services.kit.rpc.errors import FailedPrecondition, InvalidArgument


class WeightTransferError(ValueError):
    """Base of every staging error; `code` is the status a servicer answers it with."""

    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT


class InvalidWeights(InvalidArgument, WeightTransferError):
    """A slice does not fit the receiver's layout: unknown name, wrong shape, dtype or offset."""


class StaleVersion(FailedPrecondition, WeightTransferError):
    """The version is not newer than what the receiver serves or stages."""


class IncompleteVersion(FailedPrecondition, WeightTransferError):
    """Commit of a version that is not staged completely (or not staged at all)."""


class ChecksumMismatch(InvalidWeights):
    """The bytes of a slice do not match the checksum they came with (checksum.verify_slice)."""

    code = grpc.StatusCode.DATA_LOSS


class DeliveryError(RuntimeError):
    """Sender side: a version could not be delivered to a receiver (it was aborted there)."""

    def __init__(self, message: str, *, endpoint: str = "", code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.code = code
