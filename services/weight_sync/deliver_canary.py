"""The canary half of a delivery (canary.py says what is checked): the first replica of a canary
target commits alone and answers the golden prompts; the rest commit only if its drift is within
bound, otherwise it rolls back, the others abort and the version is rejected for that target."""

from __future__ import annotations

import asyncio
import logging
import math

import grpc

from services.weight_sync.transport import Endpoint
from services.weights import DeliveryError

from . import canary, metrics
from .targets import Target
from .versions import VersionBuffer

log = logging.getLogger("looprl.weight_sync")


class CanaryCommits:
    """Deliverer's canary commits (a mixin: it uses the deliverer's control channel, settings and
    failure handling)."""

    async def _canary(
        self, t: Target, staged: VersionBuffer, replica: list[Endpoint], skip: set[Endpoint]
    ) -> bool:
        """Commit `replica` alone and check it (canary.py); True when the rest may commit. On a
        rejection the replica is rolled back, the others abort, and the target is marked failed."""
        version, run_id = staged.version, staged.run_id
        settings = t.canary_settings
        config = self.model_config(run_id=run_id)
        prompts = settings.prompts or canary.default_prompts(config.vocab_size if config else 2)
        tokens = settings.tokens_per_prompt or self.canary_tokens
        bound = settings.max_logprob_drift or self.canary_max_drift
        stub = self.grpc.stub(replica[0].address)
        tag = f"canary-{t.deployment}-{version}"
        try:
            before = await canary.golden_answers(stub, prompts, tokens, tag=f"{tag}-before")
        except grpc.aio.AioRpcError as exc:
            # No reference to compare with (the replica generates nothing, or is not ready): commit
            # without a check rather than never updating; say so.
            log.warning(
                "canary of %s skipped for version %s: no reference answers (%s: %s)",
                t.deployment,
                version,
                exc.code().name,
                exc.details(),
            )
            return await self._commit_canary(t, staged, replica, skip)  # the caller commits the others
        if not await self._commit_canary(t, staged, replica, skip):
            return False
        verdict = await canary.check(stub, before, prompts, tokens, bound, tag=f"{tag}-after")
        t.canary_drift = verdict.drift if math.isfinite(verdict.drift) else -1.0
        if verdict.passed:
            log.info("canary of %s passed for version %s: %s", t.deployment, version, verdict.detail)
            return True
        log.warning("canary of %s REJECTED version %s: %s", t.deployment, version, verdict.detail)
        errors = await asyncio.gather(
            *(canary.rollback(self.grpc.stub(e.address), e, version) for e in replica)
        )
        await asyncio.gather(
            *(self.grpc.abort(e, version) for e in t.endpoints if e not in skip and e not in replica)
        )
        t.canary_rejected_version = version
        metrics.rejected(t.deployment)
        t.attempts[version] = self.retry_attempts  # checksum-valid bytes: a retry would fail the same way
        problems = "; ".join(e for e in errors if e)
        await self._failed(
            t,
            None,
            run_id=run_id,
            error=f"canary rejected version {version}: {verdict.detail}"
            + (f"; rollback failed: {problems}" if problems else ""),
        )
        if self.on_rejected is not None:
            try:
                await self.on_rejected(t, run_id, version, t.canary_drift, verdict.detail)
            except Exception as exc:
                log.warning(
                    "announcing the rejection of version %s for %s failed: %s", version, t.deployment, exc
                )
        return False

    async def _commit_canary(
        self, t: Target, staged: VersionBuffer, replica: list[Endpoint], skip: set[Endpoint]
    ) -> bool:
        """Commit the canary replica alone; on failure every rank aborts and the target fails."""
        version, run_id = staged.version, staged.run_id
        try:
            await asyncio.gather(*(self.grpc.commit(e, version) for e in replica))
        except DeliveryError as exc:
            await asyncio.gather(*(self.grpc.abort(e, version) for e in t.endpoints if e not in skip))
            await self._failed(t, self._buffer(run_id, version), f"canary commit: {exc}", run_id)
            return False
        return True
