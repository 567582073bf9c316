"""Two FSDP2 trainer ranks as Ray actors on the session's real Ray head (gloo on CPU).

One rank group serves the module (starting actors is the slow part); each test resets the policy
with setup(spec) first.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_steps import MODEL, ReferenceTrainer, make_spec, make_step, pack

from looprl.weightsync.v1 import weightsync_pb2
from services.trainer.batch import BatchRejected, to_proto
from services.trainer.ranks import RankGroup
from services.trainer.shards import reassemble

pytestmark = pytest.mark.slow

WORLD = 2


@pytest.fixture(scope="module")
def group(ray_client):
    ranks = RankGroup(WORLD, num_cpus_per_rank=0.5)
    ranks.start(make_spec())
    yield ranks
    ranks.shutdown()


def _params(group: RankGroup) -> dict[str, torch.Tensor]:
    return group.call("full_state_dict")[0]


def test_packed_logprobs_equal_each_sequence_alone(group: RankGroup) -> None:
    group.call("setup", make_spec())
    _, seqs = make_step(step=0, world_size=1, micro_per_rank=1, seqs_per_micro=5, seed=11)
    packed = to_proto(pack(seqs, 0, 1, 1)).SerializeToString()
    alone = [to_proto(pack([s], 0, 1, 1)).SerializeToString() for s in seqs]
    # Both ranks run the same forwards (FSDP all-gathers are collective).
    results = group.call("forward_logprobs", [packed, *alone])
    for logps in results:
        packed_logp, singles = logps[0], logps[1:]
        torch.testing.assert_close(packed_logp, torch.cat(singles), rtol=0, atol=1e-5)
    # And they equal an unsharded single-process model run per sequence.
    reference = ReferenceTrainer(make_spec())
    with torch.no_grad():
        expected = torch.cat([reference.logprobs_alone(s) for s in seqs])
    torch.testing.assert_close(results[0][0], expected, rtol=0, atol=1e-5)
    assert float(results[0][0].abs().sum()) > 0


@pytest.mark.parametrize("shard_layers", [True, False], ids=["per-layer", "root-only"])
def test_one_step_lowers_the_loss_and_matches_single_process_reference(
    group: RankGroup, shard_layers: bool
) -> None:
    spec = dataclasses.replace(make_spec(), shard_layers=shard_layers)
    group.call("setup", spec)
    reference = ReferenceTrainer(spec)
    per_rank, seqs = make_step(
        step=0, world_size=WORLD, micro_per_rank=2, seqs_per_micro=3, seed=5, model=reference.model
    )

    before = group.call("evaluate_loss", per_rank[0])  # same batches on both ranks: a valid collective
    metrics = group.train_step(per_rank)
    ref_loss = reference.step(seqs)

    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert 0 < metrics["clip_fraction"] < 1
    assert metrics["grad_norm"] > 0 and metrics["tokens_per_second"] > 0
    assert metrics["version"] == 1 and len(metrics["rollout_ids"]) == len(seqs)

    grads = group.call("full_grads")[0]
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(
            grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    params = _params(group)
    # Adam's first step is ~lr * g / (|g| + eps): for a gradient element near eps, float noise in g
    # (1e-4 relative, above) moves its update by up to ~1e-5 of lr's 1e-2.
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(
            params[name], p.detach(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )

    after = group.call("evaluate_loss", per_rank[0])
    assert after[0]["loss"] < before[0]["loss"]


def test_shards_reassemble_exactly_to_the_full_state_dict(group: RankGroup) -> None:
    group.call("setup", make_spec())
    per_rank, _ = make_step(step=0, world_size=WORLD, micro_per_rank=1, seqs_per_micro=2, seed=9)
    group.train_step(per_rank)  # shards of trained (not just initial) weights
    max_bytes = 4096  # force params to split across chunks and messages
    streams = group.call("shard_requests", 1, max_bytes)
    requests = [weightsync_pb2.PushShardsRequest.FromString(raw) for stream in streams for raw in stream]
    for rank, stream in enumerate(streams):
        msgs = [weightsync_pb2.PushShardsRequest.FromString(raw) for raw in stream]
        assert [m.last for m in msgs] == [False] * (len(msgs) - 1) + [True]
        assert all(m.version == 1 and m.trainer_rank == rank and m.trainer_world_size == WORLD for m in msgs)
        assert all(sum(len(c.data) for c in m.shards) <= max_bytes for m in msgs)
    # Uneven split (vocab 101 over 2 ranks): offsets must come from the layout, not vocab // world.
    assert MODEL.vocab_size % WORLD != 0
    rows_per_rank = [0] * WORLD
    for r in requests:
        for c in r.shards:
            if c.name == "model.embed_tokens.weight":
                rows_per_rank[r.trainer_rank] += c.rows
    assert sum(rows_per_rank) == MODEL.vocab_size and rows_per_rank[0] != rows_per_rank[1]
    assert not any(c.name == "lm_head.weight" for r in requests for c in r.shards)  # tied: sent once

    rebuilt = reassemble(requests)
    full = _params(group)
    full.pop("lm_head.weight", None)
    assert set(rebuilt) == set(full)
    for name, value in full.items():
        assert torch.equal(rebuilt[name], value), name


def test_shards_after_a_forward_without_backward_still_split_across_ranks(group: RankGroup) -> None:
    """FSDP2 keeps the root's params (embeddings, final norm) unsharded after a no-grad forward; a
    push right after an evaluation must still send each row from exactly one rank."""
    group.call("setup", make_spec())
    _, seqs = make_step(step=0, world_size=1, micro_per_rank=1, seqs_per_micro=2, seed=5)
    group.call("forward_logprobs", [to_proto(pack(seqs, 0, 1, 1)).SerializeToString()])
    streams = group.call("shard_requests", 1, 4096)
    requests = [weightsync_pb2.PushShardsRequest.FromString(raw) for stream in streams for raw in stream]
    rebuilt = reassemble(requests)  # raises on rows sent by both ranks
    assert rebuilt["model.embed_tokens.weight"].shape[0] == MODEL.vocab_size


@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("length", "same length"),
        ("past", "from the past"),
        ("nan", "non-finite"),
    ],
)
def test_bad_batches_are_rejected_and_leave_the_weights_alone(
    group: RankGroup, corrupt: str, message: str
) -> None:
    group.call("setup", make_spec())
    good, _ = make_step(step=0, world_size=WORLD, micro_per_rank=1, seqs_per_micro=2, seed=1)
    group.train_step(good)  # now at step 1
    before = _params(group)
    per_rank, seqs = make_step(step=1, world_size=WORLD, micro_per_rank=1, seqs_per_micro=2, seed=2)
    from looprl.packer.v1 import packer_pb2

    bad = packer_pb2.MicroBatch.FromString(per_rank[1][0])  # only rank 1 gets the bad batch
    if corrupt == "length":
        bad.advantages.CopyFrom(to_proto(pack(seqs[2:3], 1, 1, 1)).advantages)
    elif corrupt == "past":
        bad.step = 0
    else:
        adv = torch.frombuffer(bytearray(bad.advantages.data), dtype=torch.float32).clone()
        adv[-1] = float("nan")
        bad.advantages.data = adv.numpy().tobytes()
    per_rank[1] = [bad.SerializeToString()]

    with pytest.raises(BatchRejected, match=message):
        group.train_step(per_rank)
    after = _params(group)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert [s["step"] for s in group.call("state")] == [1, 1]
    group.train_step(make_step(step=1, world_size=WORLD, micro_per_rank=1, seqs_per_micro=2, seed=2)[0])


def test_unequal_micro_batch_counts_raise_a_clear_error(group: RankGroup) -> None:
    group.call("setup", make_spec())
    per_rank, _ = make_step(step=0, world_size=WORLD, micro_per_rank=2, seqs_per_micro=1, seed=4)
    per_rank[1] = per_rank[1][:1]
    with pytest.raises(BatchRejected, match="same count on every rank"):
        group.train_step(per_rank)
