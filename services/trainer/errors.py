"""Why a step, a push or a rank group failed: light enough for the trainer service's own process,
which drives the ranks and never imports torch (its ranks, Ray actors, do)."""

from __future__ import annotations

from services.kit.rpc.errors import InvalidArgument


class BatchRejected(InvalidArgument, ValueError):
    """A micro-batch failed validation; nothing was applied."""


class StepAborted(RuntimeError):
    """A rank could not take part in the step (e.g. the packer did not answer); nothing was applied."""


class PushFailed(RuntimeError):
    """Weight-sync did not take this rank's shards (unreachable, or it failed the stream)."""


class RankLost(RuntimeError):
    """A rank's actor died (its process was killed, its node lost): the group must be recreated."""
