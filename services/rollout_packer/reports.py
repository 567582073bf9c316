"""The packer's reports to the run's driver in its KV bucket (format: services/kit/messages/packer_reports.py).

- Dropped groups: a group dropped whole (all rewards equal under `filter_equal_rewards`, too stale,
  a straggler) is written before its rollouts are acked on the bus. A packer that dies in between
  drops the redelivered group again; the group id (kept per step) makes that the same drop, never
  a second one, and the keys of a run's drops are never pruned while it runs: the gateway counts
  them to know how many replacements each step is owed, after a restart too.
- Sample tables: the first rollouts of every `samples_every`-th step as text, reward, advantage,
  lengths and version, for the run's report and loggers.
"""

from __future__ import annotations

import asyncio
import logging
import time

from looprl.common.v1 import common_pb2
from services.kit.bus import subjects
from services.kit.bus.client import EVENT_RETRY_S
from services.kit.bus.kv import KV
from services.kit.messages.packer_reports import GroupDrop, encode_drops, key_step, parse_drops

log = logging.getLogger("looprl.rollout_packer")


class DroppedGroups:
    """The groups of one run the packer dropped whole, by the step that was filling."""

    def __init__(self, kv: KV, run_id: str) -> None:
        self.kv = kv
        self.run_id = run_id
        self.by_step: dict[int, list[GroupDrop]] = {}
        self._seen: set[str] = set()

    async def load(self) -> None:
        for key, raw in (await self.kv.items(subjects.packer_drops_key(self.run_id, "*"))).items():
            step = key_step(key)
            if raw and step is not None:
                self.by_step[step] = parse_drops(raw)
        self._seen = {d.group_id for drops in self.by_step.values() for d in drops}

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._seen

    async def record(self, step: int, drop: GroupDrop) -> bool:
        """Write the drop durably (retried while the bus does not answer); False when it was already
        recorded (a redelivered group dropped again)."""
        if drop.group_id in self._seen:
            return False
        drops = [*self.by_step.get(step, []), drop]
        value = encode_drops(drops)
        deadline, delay = time.monotonic() + EVENT_RETRY_S, 0.2
        while True:
            try:
                await self.kv.put(subjects.packer_drops_key(self.run_id, step), value)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() + delay > deadline:
                    # Unrecorded, nothing replaces the group: the run's stall watch will say so.
                    log.error(
                        "run %s: the drop of group %s is not recorded: %s", self.run_id, drop.group_id, exc
                    )
                    return False
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
        self.by_step[step] = drops
        self._seen.add(drop.group_id)
        return True


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sample_row(
    rollout: common_pb2.Rollout, step: int, advantage: float, tokens: int, response_tokens: int, chars: int
) -> dict:
    """One row of a samples table (gateway.v1.SampleCompletion's fields): the prompt is every turn
    before the first model turn, the completion everything from it on."""
    first_model = next((i for i, t in enumerate(rollout.turns) if t.trainable), len(rollout.turns))
    return {
        "step": step,
        "rollout_id": rollout.rollout_id,
        "group_id": rollout.group_id,
        "prompt": _cut("".join(t.text for t in rollout.turns[:first_model]), chars),
        "completion": _cut("".join(t.text for t in rollout.turns[first_model:]), chars),
        "reward": rollout.reward,
        "advantage": advantage,
        "response_tokens": response_tokens,
        "tokens": tokens,
        "weight_version": min(
            (t.weight_version for t in rollout.turns if t.trainable), default=rollout.min_weight_version
        ),
    }
