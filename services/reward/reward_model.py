"""Reward models: a Hugging Face sequence-classification model on Ray actor replicas, with request
batching and replicas scaled between min and max by queue depth.

Scoring requests arrive one text at a time (one per rollout) in bursts: the pool queues them,
cuts batches of up to `max_batch` texts (waiting at most `max_wait_s` for a batch to fill) and sends
each batch to the replica with the fewest batches in flight; the replicas are an AutoscaledPool
(services/kit/ray/autoscaled_pool.py) scaled on the texts waiting and being scored. Model loading
happens inside the replica actor, so the service process never imports torch for this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from services.kit.ray.autoscale import Autoscaler
from services.kit.ray.autoscaled_pool import AutoscaledPool
from services.reward.config import TINY, ModelPoolConfig
from services.reward.verifiers import ScoreInput, Verifier

log = logging.getLogger(__name__)


RESTART_WAIT_S = 60.0  # how long a batch waits for a crashed replica Ray is restarting (model load)


class SequenceClassifierScorer:
    """Loads the model (a local directory, or TINY: a tiny Qwen2 classifier built from a config)."""

    def __init__(self, model: str, transform: str = "sigmoid", max_length: int = 512, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        self.torch = torch
        self.transform = transform
        self.max_length = max_length
        if model == TINY:
            from transformers import Qwen2Config, Qwen2ForSequenceClassification

            from services.modeling.tokenizer import CharTokenizer

            self.tokenizer: Any = CharTokenizer()
            torch.manual_seed(seed)
            config = Qwen2Config(
                vocab_size=self.tokenizer.vocab_size,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                num_labels=1,
                pad_token_id=self.tokenizer.pad_token_id,
            )
            self.model = Qwen2ForSequenceClassification(config)
        else:
            from services.modeling.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(model)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                model, num_labels=1, local_files_only=True
            )
        self.model.eval()
        self.pad_id = int(self.tokenizer.pad_token_id)

    def score(self, texts: list[str]) -> list[float]:
        torch = self.torch
        encoded = [self.tokenizer.encode(t)[-self.max_length :] or [self.pad_id] for t in texts]
        width = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, seq in enumerate(encoded):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
        if self.transform == "sigmoid":
            logits = torch.sigmoid(logits)
        return logits.tolist()


def replica_actor_class():
    """The Ray actor class, built lazily so importing this module does not import ray."""
    import ray

    # A crashed replica is restarted by Ray (it reloads the model); the pool scores the batch it lost
    # once more (`_score`), not through Ray's task retries, which can race the pool retiring it.
    @ray.remote(num_cpus=0.5, max_restarts=-1)
    class RewardModelReplica:
        def __init__(self, model: str, transform: str = "sigmoid", max_length: int = 512) -> None:
            self.scorer = SequenceClassifierScorer(model, transform, max_length)
            self.batches = 0
            self.batch_sizes: list[int] = []

        def score(self, texts: list[str]) -> list[float]:
            self.batches += 1
            self.batch_sizes.append(len(texts))
            return self.scorer.score(texts)

        def stats(self) -> dict:
            return {"batches": self.batches, "batch_sizes": self.batch_sizes}

    return RewardModelReplica


class RewardModelPool:
    """Batching front and replica autoscaler for one reward model. Use from one event loop."""

    def __init__(self, config: ModelPoolConfig, make_replica: Callable[[], Any] | None = None) -> None:
        self.config = config
        autoscaler = Autoscaler(
            config.min_replicas,
            config.max_replicas,
            config.target_queue_per_replica,
            config.scale_down_after_s,
        )
        self.pool: AutoscaledPool[Any] = AutoscaledPool(
            autoscaler,
            make_replica or self._ray_replica,
            _kill,
            lambda: self.queue_depth,
            config.scale_interval_s,
        )
        self._queue: asyncio.Queue[tuple[str, asyncio.Future]] = asyncio.Queue()
        self._inflight_items = 0
        self._tasks: list[asyncio.Task] = []
        self.batches_sent = 0

    def _ray_replica(self) -> Any:
        cls = replica_actor_class()
        return cls.remote(self.config.model, self.config.transform)

    async def start(self) -> RewardModelPool:
        self.pool.start()
        self._tasks = [asyncio.ensure_future(self._batch_loop())]
        return self

    @property
    def replicas(self) -> int:
        return len(self.pool)

    @property
    def peak_replicas(self) -> int:
        return self.pool.peak

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize() + self._inflight_items

    async def score(self, text: str) -> float:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put((text, future))
        return await future

    def verifier(self) -> Verifier:
        async def reward_model(inp: ScoreInput) -> float:
            return await self.score(inp.transcript or inp.completion)

        return reward_model

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.pool.close()

    async def _batch_loop(self) -> None:
        inflight: set[asyncio.Task] = set()
        while True:
            batch = [await self._queue.get()]
            # Let a burst arrive, then take what is there (no wait_for around get: in 3.11 a
            # timeout racing a get can drop the item).
            if self._queue.qsize() + 1 < self.config.max_batch:
                await asyncio.sleep(self.config.max_wait_s)
            while len(batch) < self.config.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            task = asyncio.ensure_future(self._dispatch(batch))
            inflight.add(task)
            task.add_done_callback(inflight.discard)

    async def _dispatch(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        while (replica := self.pool.least_loaded()) is None:
            await asyncio.sleep(0.01)
        replica.in_flight += 1
        self._inflight_items += len(batch)
        self.batches_sent += 1
        try:
            scores = await self._score(replica.handle, [text for text, _ in batch])
        except Exception as exc:  # the verifier wrapper reports it as a failed component
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(RuntimeError(f"reward model replica failed: {exc}"))
            return
        finally:
            replica.in_flight -= 1
            self._inflight_items -= len(batch)
        for (_, fut), value in zip(batch, scores, strict=True):
            if not fut.done():
                fut.set_result(float(value))

    async def _score(self, replica: Any, texts: list[str]) -> list[float]:
        """Scores from `replica`, asked again while Ray restarts it after a crash (RESTART_WAIT_S)."""
        import ray

        deadline = asyncio.get_running_loop().time() + RESTART_WAIT_S
        while True:
            try:
                return await replica.score.remote(texts)
            except ray.exceptions.ActorUnavailableError:  # restarting: ask again until it is back
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def _kill(handle: Any) -> None:
    with contextlib.suppress(Exception):
        import ray

        ray.kill(handle)
