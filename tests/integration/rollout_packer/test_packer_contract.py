"""Contract: what the packer serves passes the trainer's own decode and validation, padding included."""

from __future__ import annotations

import numpy as np

from bench.harness.synthetic_rollouts import make_rollout
from looprl.packer.v1 import packer_pb2
from services.rollout_packer.groups import Group
from services.rollout_packer.sequences import sequence_from_rollout
from services.rollout_packer.servicer import micro_batch_to_proto
from services.rollout_packer.step import PackerSettings, build_step
from services.trainer.batch import from_proto, validate_rank_batches


def test_trainer_accepts_every_rank_of_a_packed_step() -> None:
    groups = []
    for g in range(3):
        members = [
            sequence_from_rollout(
                make_rollout(
                    f"g{g}-{i}",
                    f"g{g}",
                    group_size=2,
                    sample_index=i,
                    reward=float(i),
                    completion_len=5 + 9 * g + i,
                    env_turn_len=3,
                )
            )
            for i in range(2)
        ]
        groups.append(Group(f"g{g}", members))
    world = 4  # more micro-batch slots than sequences fit evenly: some ranks get padding micro-batches
    step = build_step(3, groups, 0, PackerSettings(max_tokens_per_microbatch=40), world_size=world)
    counts = set()
    for rank in range(world):
        wire = [micro_batch_to_proto(mb).SerializeToString() for mb in step.micro_batches(rank)]
        decoded = [from_proto(packer_pb2.MicroBatch.FromString(b)) for b in wire]
        validate_rank_batches(decoded, expected_step=3, vocab_size=1000)
        counts.add(len(decoded))
        for mb in decoded:
            assert mb.global_sequences == 6
            np.testing.assert_array_equal(mb.advantages[mb.loss_mask == 0].numpy(), 0)
    assert len(counts) == 1
