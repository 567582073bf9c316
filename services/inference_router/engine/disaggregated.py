"""The CPU engine as a worker of a disaggregated deployment: it prefills for other workers, and
decodes from KV other workers prefilled.

Every worker is a whole CPUEngine (the router picks which requests it gets: a tuner may move a
worker from one stage to the other), with two more kinds of request beside the ordinary one:

- **prefill for transfer** (`prefill_for_transfer`): the prompt is prefilled in the next step's
  batch with the other admitted prompts; its keys, values and last-position logits are written to
  the worker's `KVStore` (engine/kv_transfer.py) and the slot is freed at once, no token sampled.
  The answer says where the KV waits and which weight version made it.
- **decode from KV** (`KVRequest` with `kv`): admitted like any request, but its slots are filled
  by copying the handed-over KV instead of computing it, and its first token of each completion
  is sampled from the handed-over logits, with the request's own seeded generators. Prefill is
  batch-invariant (services/modeling/engine_model.py), so the tokens and log-probs are bit for bit
  what a co-located engine samples for the same seed.

Weight versions: KV made under one version is never decoded under another. A handed-over KV of a
version other than the one this worker serves when the request is admitted is not used: the prompt
is recomputed here (`KVRequest.recomputed` says so and why); and this worker runs with
`kv_on_swap = "recompute"` (engine/scheduler.py), so a swap re-prefills its running sequences under
the new weights before their next token. Each completion records, per token, the version it was
sampled under and the version of the KV it was sampled from (`Completion.kv_versions`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import time
from dataclasses import dataclass, field

import torch

from services.inference_router.engine.base import EngineRequest
from services.inference_router.engine.cpu import CPUEngine, LocalExecutor
from services.inference_router.engine.kv_transfer import KVStore, PromptKV, encode
from services.inference_router.engine.scheduler import SchedulerLimits, _Seq
from services.kit.rpc.errors import Unavailable

RECOMPUTE = "recompute"


@dataclass
class KVRequest(EngineRequest):
    """A request of a disaggregated deployment's worker: `export` (prefill only, hand the KV over),
    or `kv` (decode from a handed-over prompt KV; None: compute the prompt here)."""

    export: bool = False
    kv: PromptKV | None = None
    # Set by the engine when it did not use `kv`: why it computed the prompt itself.
    recomputed: str = ""


@dataclass(frozen=True)
class KVHandle:
    """Where a prefill worker left a prompt's KV, and the version that made it."""

    kv_id: str
    version: int
    prompt_tokens: int
    nbytes: int


@dataclass
class TransferStats:
    exported: int = 0
    export_bytes: int = 0
    export_seconds: float = 0.0
    imported: int = 0
    import_seconds: float = 0.0
    recomputed: dict[str, int] = field(default_factory=dict)


class DisaggregatedEngine(CPUEngine):
    """A CPUEngine that also prefills for transfer and decodes from handed-over KV."""

    store: KVStore
    transfer: TransferStats

    @classmethod
    def create(cls, *args, kv_store: KVStore | None = None, **kwargs) -> DisaggregatedEngine:
        limits = dataclasses.replace(kwargs.pop("limits", None) or SchedulerLimits(), kv_on_swap="recompute")
        engine = super().create(*args, limits=limits, **kwargs)
        assert isinstance(engine, DisaggregatedEngine)
        engine.store = kv_store or KVStore()
        engine.transfer = TransferStats()
        return engine

    async def prefill_for_transfer(self, request: EngineRequest) -> KVHandle:
        """Prefill `request`'s prompt with the next step's batch and hand its KV over."""
        sampling = dataclasses.replace(request.sampling, n=1, max_tokens=1)
        req = KVRequest(
            request.prompt_token_ids, sampling, request.session_id, request.request_id, export=True
        )
        item = self._enqueue(req, stream=False)
        handle = await item.done
        if not isinstance(handle, KVHandle):  # aborted: the engine closed
            raise Unavailable(
                f"prefill of {request.request_id or 'a request'} did not finish (engine closed)"
            )
        return handle

    async def close(self) -> None:
        await super().close()
        self.store.close()

    def status(self):
        self.store.sweep()
        out = super().status()
        t = self.transfer
        out.extra |= {
            "kv_exported": t.exported,
            "kv_export_bytes": t.export_bytes,
            "kv_export_seconds": t.export_seconds,
            "kv_imported": t.imported,
            "kv_import_seconds": t.import_seconds,
            "kv_held": self.store.held,
            "kv_expired": self.store.expired,
        } | {f"kv_recomputed_{why}": n for why, n in t.recomputed.items()}
        return out

    # ---------------------------------------------------------------- the step's prefill
    async def _prefill_admitted(self, admitted: list[_Seq]) -> None:
        imports = [s for s in admitted if self._usable_kv(s)]
        computed = [s for s in admitted if getattr(s.owner.req, "kv", None) is None]
        if computed:
            logits = await self._prefill(computed, [s.owner.req.prompt_token_ids for s in computed])
            exports = [i for i, s in enumerate(computed) if _export(s)]
            if exports:
                await self._hand_over([computed[i] for i in exports], logits[exports])
            sampled = [i for i, s in enumerate(computed) if not _export(s)]
            if sampled:
                self._sample_and_append([computed[i] for i in sampled], logits[sampled])
        if imports:
            start = time.perf_counter()
            logits = await asyncio.get_running_loop().run_in_executor(self._pool, self._install, imports)
            self.transfer.import_seconds += time.perf_counter() - start
            self.transfer.imported += len({id(s.owner) for s in imports})
            for seq in imports:
                seq.kv_version = _handed_kv(seq).version
            self._sample_and_append(imports, logits)

    def _usable_kv(self, seq: _Seq) -> bool:
        """Whether the sequence continues from handed-over KV (else its prompt is computed here)."""
        req = seq.owner.req
        if not isinstance(req, KVRequest) or req.kv is None:
            return False
        kv = req.kv
        why = ""
        if kv.version != self.version:
            why = "version"
        elif kv.prompt_tokens != len(req.prompt_token_ids) or kv.logits.numel() != self.executor.vocab_size:
            why = "shape"
        if why:
            if not req.recomputed:
                req.recomputed = why
                self.transfer.recomputed[why] = self.transfer.recomputed.get(why, 0) + 1
            req.kv = None
            return False
        return True

    def _install(self, seqs: list[_Seq]) -> torch.Tensor:
        """Copy each sequence's handed-over KV into its slot; the logits its first token is sampled
        from [S, V]. Runs on the engine's worker thread."""
        executor = self.executor
        assert isinstance(executor, LocalExecutor)
        cache = executor.cache
        for seq in seqs:
            kv = _handed_kv(seq)
            n = kv.prompt_tokens
            cache.k[:, seq.slot, :, :n] = kv.keys
            cache.v[:, seq.slot, :, :n] = kv.values
            cache.lengths[seq.slot] = n
        return torch.stack([_handed_kv(seq).logits for seq in seqs])

    async def _hand_over(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Write each exported prompt's KV to the store, free its slot and answer with the handle."""
        start = time.perf_counter()
        handles = await asyncio.get_running_loop().run_in_executor(self._pool, self._write, seqs, logits)
        self.transfer.export_seconds += time.perf_counter() - start
        for seq, handle in zip(seqs, handles, strict=True):
            self.transfer.exported += 1
            self.transfer.export_bytes += handle.nbytes
            if seq.finish:  # aborted while the step ran: its slot is free already
                continue
            seq.finish = "export"
            heapq.heappush(self._free_slots, seq.slot)
            if not seq.owner.done.done():
                seq.owner.done.set_result(handle)
        self._running = [s for s in self._running if not s.finish]

    def _write(self, seqs: list[_Seq], logits: torch.Tensor) -> list[KVHandle]:
        executor = self.executor
        assert isinstance(executor, LocalExecutor)
        cache = executor.cache
        out = []
        for seq, row in zip(seqs, logits, strict=True):
            n, prompt = seq.prompt_len, seq.owner.req.prompt_token_ids
            blob = encode(cache.k[:, seq.slot, :, :n], cache.v[:, seq.slot, :, :n], row, self.version, prompt)
            out.append(KVHandle(self.store.put(blob), self.version, n, len(blob)))
        return out


def _export(seq: _Seq) -> bool:
    return bool(getattr(seq.owner.req, "export", False))


def _handed_kv(seq: _Seq) -> PromptKV:
    """The handed-over KV a sequence decodes from (only sequences `_usable_kv` accepted get here)."""
    req = seq.owner.req
    assert isinstance(req, KVRequest) and req.kv is not None
    return req.kv
