"""What the rollout-packer tells a run's driver (the gateway) through its KV bucket, beside the step
plans: the format both sides read (services/rollout_packer/reports.py writes it).

- `<run>.drops.<step>` (`subjects.packer_drops_key`): the groups the packer dropped whole while
  `step` was the step being filled, in the order dropped, each with its reason (a DropReason value:
  zero_variance_group, stale, group_too_small, straggler_timeout) and detail. The gateway feeds one
  newly sampled group for each, so every step still trains a full batch.
- `<run>.samples.<step>` (`subjects.packer_samples_key`): a JSON list of rows with the fields of
  gateway.v1.SampleCompletion.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GroupDrop:
    group_id: str
    reason: str
    detail: str


def encode_drops(drops: list[GroupDrop]) -> bytes:
    return json.dumps([asdict(d) for d in drops]).encode()


def parse_drops(raw: bytes) -> list[GroupDrop]:
    return [GroupDrop(**entry) for entry in json.loads(raw)]


def key_step(key: str) -> int | None:
    """The step a `<run>.<kind>.<step>` key names (None when the last token is not a step)."""
    last = key.rpartition(".")[2]
    return int(last) if last.isdigit() else None
