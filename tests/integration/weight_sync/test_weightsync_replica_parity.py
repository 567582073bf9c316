"""End to end, with nothing in-process: a 2-rank FSDP trainer (TrainerWorker Ray actors, gloo) pushes
its own dim-0 shards to the weight-sync service (its own process), which reshards them for two
deployments of real InferenceReplica Ray actors: tp=1 with Hugging Face names, tp=2 with vLLM's
fused names (its second rank a TP worker actor of the replica).

Version 1 (the trainer's initial weights) travels over gRPC, each deployment behind a byte-counting
TCP proxy; version 2 (after one real training step on the replicas' own rollouts) over shared
memory, as weight-sync delivers to replicas on its host; a second tp=1 deployment makes the two tp=1
replicas share one copy of version 2 (each serving from it read-only, each verifying half of it).
After each sync:
- both deployments serve the new version, and the log-probs they report for the tokens they
  generate on fixed prompts (seeded sampling and greedy) equal the trainer's own log-probs of those
  tokens (its FSDP forward) within 1e-4 (fp32). The weights they served before are far from it
  (checked, > 100x the tolerance), so the check fails if the sync did not happen or resharded
  anything wrongly (norms and biases are random too, not ones and zeros);
- byte accounting: each deployment is sent the model once. tp=1 gets exactly the model (tied
  lm_head once); tp=2 gets it once across its two ranks plus the only tensors this layout replicates
  on every rank, the RMSNorm weights (embed_tokens is vocab-parallel, split by rows as vLLM does, see
  services/modeling/layouts.py; kv heads are split, not replicated: tp=2 == num_key_value_heads).
  The payload is asserted exactly (weight-sync's
  per-deployment count); the bytes that reached each deployment's socket (gRPC, through the proxy)
  are that payload plus metadata of bounded size.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc
from services.kit.config.recipe import DeploymentSpec, ModelSection, OptimizerSection, Recipe, SamplingSection
from services.modeling.config import ModelConfig
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.trainer.batch import PackedMicroBatch
from services.trainer.ranks import RankGroup
from services.trainer.spec import TrainerSpec
from tests.support.byte_counting_proxy import ByteCountingProxy
from tests.support.weight_sync_process import weight_sync_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# 4 query heads, 2 kv heads: tp=2 splits the kv heads (no replication). Tied lm_head.
CONFIG = ModelConfig.tiny(vocab_size=96, max_position_embeddings=256)
F32 = 4
# The numbers the accounting asserts, by hand from CONFIG (V=96, H=64, I=128, L=2, 4x16 q, 2x16 kv):
#   embed_tokens V*H = 6144; per layer q 64*64 + 64, k 32*64 + 32, v 32*64 + 32, o 64*64,
#   gate/up/down 3 * 128*64, two norms 2*64 = 37120; final norm 64; lm_head tied (not counted).
MODEL_PARAMS = 6144 + 2 * 37120 + 64  # 80_448
MODEL_BYTES = MODEL_PARAMS * F32  # 321_792
# Replicated on each tp rank: the 2*2 layer norms + the final norm. embed_tokens is split by
# vocabulary rows (48 + 48 of V=96), so it travels once like the other split tensors.
REPLICATED_BYTES = (5 * 64) * F32  # 1_280
TP1_BYTES = MODEL_BYTES  # 321_792
TP2_BYTES = MODEL_BYTES + (2 - 1) * REPLICATED_BYTES  # 323_072
# Metadata on the wire per deployment: slice descriptors (name, shape, offset, checksum) per
# tensor and bucket, the config.json once per rank stream, gRPC/HTTP2 framing (9 + 5 bytes per
# frame/message), and the commit call. Measured ~5-8 KiB here; the bound leaves room, and is far
# below a second copy of the model (which is what a tp=2 receiving the model per rank would add).
METADATA_BOUND = 32 << 10
BUCKET_BYTES = 64 << 10  # several buckets per rank, so bucket boundaries are crossed
PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6], [1]]
TEMPERATURES = [1.0, 1.0, 0.0, 1.0]  # sampled (seeded) and greedy; log-probs are at temperature 1
MAX_TOKENS = 6
TOLERANCE = 1e-4


def _expected_from_config(config: ModelConfig, tp: int) -> int:
    """Bytes one fp32 deployment of tensor-parallel degree `tp` must receive (fused when tp > 1)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    layer_sharded = (q * h + q) + 2 * (kv * h + kv) + h * q + 3 * i * h  # split across the tp ranks
    vocab_sharded = v * h * (1 if config.tie_word_embeddings else 2)  # embed_tokens (+ untied lm_head)
    norms = 2 * config.num_hidden_layers * h + h  # the only tensors every rank holds
    assert tp <= config.num_key_value_heads, "kv heads would be replicated: account for them"
    return (config.num_hidden_layers * layer_sharded + vocab_sharded + tp * norms) * F32


def _random_model(seed: int) -> Qwen2ForCausalLM:
    """Random weights everywhere (norms around 1, biases around 0, not exactly), so a norm or bias
    that lands in the wrong place changes the log-probs too."""
    model = Qwen2ForCausalLM(CONFIG, seed=None)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.15 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def weight_sync(tmp_path_factory):
    with weight_sync_process(tmp_path_factory.mktemp("ws"), bucket_bytes=str(BUCKET_BYTES)) as running:
        yield running


def _generate(actor, prompt: list[int], temperature: float, seed: int) -> inference_pb2.Completion:
    import ray

    request = inference_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed),
    )
    reply = inference_pb2.GenerateResponse.FromString(
        ray.get(actor.generate.remote(request.SerializeToString()), timeout=120)
    )
    return reply.completions[0]


def _answers(actor, seed: int) -> list[inference_pb2.Completion]:
    return [
        _generate(actor, p, t, seed + i) for i, (p, t) in enumerate(zip(PROMPTS, TEMPERATURES, strict=True))
    ]


def _sequences(completions: list[inference_pb2.Completion]) -> list[list[int]]:
    return [p + list(c.token_ids) for p, c in zip(PROMPTS, completions, strict=True)]


def _full_model_logprobs(model: Qwen2ForCausalLM, sequences: list[list[int]]) -> torch.Tensor:
    mb = _microbatch(sequences)
    with torch.no_grad():
        logits = model(mb.input_ids, mb.position_ids, mb.cu_seqlens)
    return token_logprobs(logits, mb.input_ids, mb.cu_seqlens, temperature=1.0)


def _microbatch(sequences: list[list[int]]) -> PackedMicroBatch:
    """The sequences packed as one micro-batch (only the forward reads it: no loss fields matter)."""
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in sequences]).cumsum(0).tolist()], dtype=torch.long)
    zeros = torch.zeros(len(ids))
    return PackedMicroBatch(
        step=0,
        input_ids=ids,
        position_ids=positions,
        cu_seqlens=cu,
        loss_mask=zeros,
        advantages=zeros,
        behaviour_logprobs=zeros,
        versions=zeros.long(),
        global_loss_tokens=1,
        global_sequences=len(sequences),
    )


def _completion_logprobs(per_token: torch.Tensor, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Split packed per-token log-probs back into each sequence's completion tokens."""
    out, start = [], 0
    for prompt, seq in zip(PROMPTS, sequences, strict=True):
        out.append(per_token[start + len(prompt) : start + len(seq)])
        start += len(seq)
    return out


def _wait_synced(stub, version: int, deployments: set[str], timeout: float, log_path: str):
    deadline = time.monotonic() + timeout
    reply = None
    while time.monotonic() < deadline:
        reply = stub.GetVersion(weightsync_pb2.GetVersionRequest(), timeout=10)
        states = {t.deployment: t for t in reply.targets}
        if all(
            d in states and states[d].version == version and states[d].state == "ready" for d in deployments
        ):
            return states
        failed = [t for t in reply.targets if t.state == "failed"]
        assert not failed, f"delivery failed: {failed}"
        time.sleep(0.2)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-6000:]
    raise AssertionError(
        f"version {version} not delivered within {timeout}s: {reply}\nweight-sync log:\n{tail}"
    )


def _register(stub, name: str, tp: int, addresses: list[str], host_id: str) -> None:
    """Register one deployment as the router does (services/inference_router/deployments.py); an
    empty host_id (unknown host) gets gRPC, the replica's own gets shared memory."""
    stub.RegisterTarget(
        weightsync_pb2.RegisterTargetRequest(
            deployment=name,
            layout=weightsync_pb2.TargetLayout(
                tensor_parallel=tp, naming="hf" if tp == 1 else "fused", dtype=common_pb2.D_TYPE_FLOAT32
            ),
            ranks=[
                weightsync_pb2.TargetRank(rank=r, address=a, host_id=host_id, replica=f"{name}-r0")
                for r, a in enumerate(addresses)
            ],
        ),
        timeout=10,
    )


def _train_batch(rank: int, completions: list[inference_pb2.Completion], loss_tokens: int, sequences: int):
    """One rank's micro-batch of step 0 from a deployment's rollouts: the replica's tokens and
    behaviour log-probs, +1/-1 advantages."""
    mb = _microbatch(_sequences(completions))
    mask, behaviour, adv = [], [], []
    for i, (prompt, comp) in enumerate(zip(PROMPTS, completions, strict=True)):
        n = len(comp.token_ids)
        mask += [0.0] * len(prompt) + [1.0] * n
        behaviour += [0.0] * len(prompt) + list(comp.logprobs)
        adv += [0.0] * len(prompt) + [1.0 if i % 2 == 0 else -1.0] * n
    mb.loss_mask, mb.behaviour_logprobs, mb.advantages = (
        torch.tensor(mask),
        torch.tensor(behaviour),
        torch.tensor(adv),
    )
    mb.versions = torch.ones(len(mask), dtype=torch.long)
    mb.global_loss_tokens, mb.global_sequences, mb.rank = loss_tokens, sequences, rank
    return mb


def _assert_serving_like_trainer(trainer, replicas, version: int, previous: Qwen2ForCausalLM, seed: int):
    """Every deployment serves `version` and scores its own tokens as the trainer does (within
    TOLERANCE), while the weights served before would be far off. Returns the completions."""
    import ray

    out = {}
    for name, actor in replicas.items():
        assert ray.get(actor.status.remote(), timeout=60).weight_version == version
        comps = _answers(actor, seed=seed)
        assert all(c.weight_version == version and len(c.token_ids) == MAX_TOKENS for c in comps), comps
        seqs = _sequences(comps)
        trainer_lps = trainer.call("forward_logprobs", [_microbatch(seqs)], timeout=120)
        # Both FSDP ranks ran the same (collective) forward.
        torch.testing.assert_close(trainer_lps[0][0], trainer_lps[1][0], rtol=0, atol=0)
        refs = _completion_logprobs(trainer_lps[0][0], seqs)
        stale = _completion_logprobs(_full_model_logprobs(previous, seqs), seqs)
        for prompt, comp, ref in zip(PROMPTS, comps, refs, strict=True):
            diff = (torch.tensor(comp.logprobs) - ref).abs().max().item()
            assert diff <= TOLERANCE, f"{name} v{version} prompt {prompt}: max |log-prob diff| {diff:.2e}"
        gap = max(
            (torch.tensor(c.logprobs) - o).abs().max().item() for c, o in zip(comps, stale, strict=True)
        )
        assert gap > 100 * TOLERANCE, f"{name}: the previous weights score too close to v{version} ({gap})"
        out[name] = comps
    return out


def test_trainer_weights_reach_tp1_and_tp2_replicas_exactly_once_and_score_like_the_trainer(
    ray_client, weight_sync, tmp_path
):
    import ray

    from services.inference_router.replica_actor import InferenceReplica

    assert _expected_from_config(CONFIG, 1) == TP1_BYTES == 321_792
    assert _expected_from_config(CONFIG, 2) == TP2_BYTES == 323_072

    trainer_dir, initial_dir = tmp_path / "trainer-init", tmp_path / "replica-init"
    trainer_model = _random_model(seed=11)
    trainer_model.save_pretrained(trainer_dir)
    initial_model = _random_model(seed=12)
    initial_model.save_pretrained(initial_dir)
    assert sum(p.numel() for p in trainer_model.parameters()) == MODEL_PARAMS  # tied: counted once

    address, log_path = weight_sync
    channel = grpc.insecure_channel(address)
    ws = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
    # two tp=1 deployments: over shared memory they serve from one shared copy of the weights
    deployments = {"hf-tp1": 1, "fused-tp2": 2, "hf-tp1-b": 1}
    replicas = {
        name: InferenceReplica.options(num_cpus=0.25, max_restarts=0).remote(
            spec=DeploymentSpec(
                name=name, tensor_parallel=tp, model_path=str(initial_dir), max_model_len=64, max_batch_size=4
            ),
            replica=f"{name}-r0",
            num_threads=1,
        )
        for name, tp in deployments.items()
    }
    trainer = RankGroup(2, num_cpus_per_rank=0.25, ready_timeout_s=180)
    spec = TrainerSpec(
        recipe=Recipe(
            model=ModelSection(path=str(trainer_dir)),
            sampling=SamplingSection(temperature=1.0),
            # A step large enough that version 2 scores far from version 1 (Adam's first step ~ lr*sign(g)).
            optimizer=OptimizerSection(lr=2e-2, eps=1e-6, grad_clip=0.0),
        ),
        push_max_bytes=48 << 10,
    )
    proxies: dict[str, ByteCountingProxy] = {}
    try:
        started = time.monotonic()
        # Replicas load version 0 (other weights) from their model path while the trainer ranks
        # build and FSDP-shard theirs.
        pending = [actor.status.remote() for actor in replicas.values()]
        trainer.start(spec)
        statuses = dict(zip(replicas, ray.get(pending, timeout=180), strict=True))
        for name, st in statuses.items():
            assert st.weight_version == 0 and st.ready, st
            assert len(st.rank_addresses) == deployments[name]
        print(f"started in {time.monotonic() - started:.1f}s")
        # Version 0 is far from the trainer's weights. Scored by the full model in this process, not
        # the trainer's forward_logprobs: a forward without backward leaves the FSDP root's
        # parameters (embed_tokens, norm) unsharded, and a push after it sends them whole from both
        # ranks, which weight-sync rejects as overlapping rows (trainer issue, reported; the fix is
        # model.reshard() before reading local shards).
        for name, actor in replicas.items():
            comps = _answers(actor, seed=100)
            seqs = _sequences(comps)
            refs = _completion_logprobs(_full_model_logprobs(trainer_model, seqs), seqs)
            gap = max(
                (torch.tensor(c.logprobs) - r).abs().max().item() for c, r in zip(comps, refs, strict=True)
            )
            assert all(c.weight_version == 0 for c in comps) and gap > 100 * TOLERANCE, (name, gap)

        # ---- version 1 over gRPC, each deployment behind a byte-counting proxy (every rank of a
        # replica receives on the replica's one server).
        for name, tp in deployments.items():
            proxies[name] = ByteCountingProxy(statuses[name].address).start()
            _register(ws, name, tp, [proxies[name].address] * tp, host_id="")
        t0 = time.monotonic()
        pushed = trainer.push_weights(address, 1)
        states = _wait_synced(ws, 1, set(deployments), 120, log_path)
        print(f"v1 pushed and delivered in {time.monotonic() - t0:.2f}s")

        # The trainer sent the model once across its two ranks (each its own dim-0 rows).
        assert [p["rank"] for p in pushed] == [0, 1] and all(p["version"] == 1 for p in pushed)
        assert sum(p["bytes"] for p in pushed) == MODEL_BYTES, pushed
        assert all(0 < p["bytes"] < MODEL_BYTES for p in pushed), pushed
        assert states["hf-tp1"].last_bytes == states["hf-tp1-b"].last_bytes == TP1_BYTES
        assert states["fused-tp2"].last_bytes == TP2_BYTES
        for name, expected in (("hf-tp1", TP1_BYTES), ("fused-tp2", TP2_BYTES), ("hf-tp1-b", TP1_BYTES)):
            wire = proxies[name].counts()[0]
            print(f"{name}: payload {expected} B, on the wire {wire} B (+{wire - expected} B metadata)")
            assert expected < wire <= expected + METADATA_BOUND, (name, wire, expected)
        rollouts = _assert_serving_like_trainer(trainer, replicas, 1, initial_model, seed=200)
        wire_v1 = {name: proxy.counts() for name, proxy in proxies.items()}

        # ---- one training step on those rollouts (rank r trains on deployment r's), then
        # version 2 over shared memory: the replicas are registered again at their own addresses.
        for name, tp in deployments.items():
            _register(ws, name, tp, statuses[name].rank_addresses, host_id=statuses[name].host_id)
        _wait_synced(ws, 1, set(deployments), 60, log_path)  # nothing to send: both already serve v1
        loss_tokens = sum(len(c.token_ids) for name in ("hf-tp1", "fused-tp2") for c in rollouts[name])
        batches = [
            [_train_batch(r, rollouts[name], loss_tokens, 2 * len(PROMPTS))]
            for r, name in enumerate(("hf-tp1", "fused-tp2"))
        ]
        metrics = trainer.train_step(batches)
        assert metrics["version"] == 1 and metrics["grad_norm"] > 0, metrics
        t0 = time.monotonic()
        pushed = trainer.push_weights(address, 2)
        states = _wait_synced(ws, 2, set(deployments), 120, log_path)
        print(f"v2 pushed and delivered in {time.monotonic() - t0:.2f}s")
        assert sum(p["bytes"] for p in pushed) == MODEL_BYTES, pushed
        assert states["hf-tp1"].last_bytes == states["hf-tp1-b"].last_bytes == TP1_BYTES
        assert states["fused-tp2"].last_bytes == TP2_BYTES
        with open(log_path) as f:  # the two tp=1 replicas were served one shared copy
            assert "version 2: one shared copy for" in f.read()
        _assert_serving_like_trainer(trainer, replicas, 2, trainer_model, seed=300)
        # Nothing of version 2 went through the old (gRPC) registrations.
        assert {name: proxy.counts() for name, proxy in proxies.items()} == wire_v1
    except BaseException:
        with open(log_path, errors="replace") as f:
            print("weight-sync log:\n" + f.read()[-8000:])
        raise
    finally:
        for proxy in proxies.values():
            proxy.stop()
        channel.close()
        trainer.shutdown()
        for actor in replicas.values():
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(actor, no_restart=True)
