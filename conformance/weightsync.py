"""The weight-sync contract (looprl.weightsync.v1.WeightSyncService): a version completes once every
trainer rank pushed it, verified chunk by chunk (a checksum mismatch is DATA_LOSS and that version
never completes), versions only move forward, and every registered target receives the latest
version, byte for byte, until it is unregistered.

The kit pushes versions of a run of its own (`conformance-<random>`, seeded random weights of
`--option model_config`, looprl's tiny preset by default) and registers a receiver it serves itself
(`--option receiver_host`, default 127.0.0.1, must be reachable from weight-sync; its certificate is
the `--option receiver_identity` one, default inference-router, as looprl's replicas serve). A
deployment registered for every run (an empty run id) receives the kit's versions too: run the kit
against a weight-sync no run is using.
"""

from __future__ import annotations

import secrets
import time

from conformance.case import Contract, check
from conformance.common import add_common
from conformance.receiver import Receiver
from conformance.target import Session
from conformance.weights import Model, push_requests
from looprl.common.v1 import common_pb2
from looprl.weightsync.v1 import weightsync_pb2 as pb

SERVICE = "looprl.weightsync.v1.WeightSyncService"
DELIVERY_S = 60.0


def _setup(s: Session) -> None:
    tag = secrets.token_hex(4)
    s.facts["run"], s.facts["deployment"] = f"conformance-{tag}", f"conformance-{tag}/engine"
    s.facts["model"] = Model.from_option(s.option("model_config"))


def _teardown(s: Session) -> None:
    receiver = s.facts.get("receiver")
    if s.facts.get("registered"):
        try:
            s.unary(
                "UnregisterTarget",
                pb.UnregisterTargetRequest(deployment=s.facts["deployment"]),
                pb.UnregisterTargetResponse,
            )
        except Exception:
            pass
    if receiver is not None:
        receiver.stop()


contract = Contract(
    "weight-sync",
    SERVICE,
    "versioned, verified delivery of trainer weights: PushShards, RegisterTarget, GetVersion, RequestSync, UnregisterTarget",
    options={
        "model_config": "a Hugging Face config.json of the model to push (default: looprl's tiny preset)",
        "receiver_host": "address the kit's receiving engine listens on, reachable from weight-sync (default 127.0.0.1)",
        "receiver_identity": "certificate identity of the kit's receiving engine (default inference-router)",
    },
    setup=_setup,
    teardown=_teardown,
)
add_common(contract, "GetVersion", pb.GetVersionRequest())


def _push(s: Session, requests: list[pb.PushShardsRequest]) -> pb.PushShardsResponse:
    return s.stream_unary("PushShards", requests, pb.PushShardsResponse)


def _latest(s: Session) -> pb.GetVersionResponse:
    return s.unary("GetVersion", pb.GetVersionRequest(run_id=s.facts["run"]), pb.GetVersionResponse)


def _version(s: Session, version: int, **kw) -> list[pb.PushShardsRequest]:
    return push_requests(s.facts["model"], version, s.facts["run"], **kw)


@contract.case(
    "get_version.shape",
    "GetVersion",
    "reports the latest complete version and every target with its version and state",
    "OK",
    "looprl.weightsync.v1.GetVersionResponse.latest_version",
    "-1 before any",
)
def _get_version(s: Session) -> None:
    reply = s.unary("GetVersion", pb.GetVersionRequest(), pb.GetVersionResponse)
    check(reply.latest_version >= -1, f"latest_version {reply.latest_version}")
    names = [t.deployment for t in reply.targets]
    check(all(names) and len(set(names)) == len(names), f"target names {names}")
    fresh = _latest(s)
    check(
        fresh.latest_version == -1 and not fresh.targets,
        f"a run nobody pushed has latest_version {fresh.latest_version} and {len(fresh.targets)} targets",
    )


def _field_case(id: str, field: str, change, proto: str, quote: str) -> None:
    def run(s: Session) -> None:
        requests = _version(s, 0)
        change(requests)
        s.refused("INVALID_ARGUMENT", lambda: _push(s, requests), naming=field)

    contract.add(
        id, "PushShards", f"{field} out of range is refused naming it", "INVALID_ARGUMENT", proto, quote, run
    )


def _set(field: str, value):
    def change(requests: list[pb.PushShardsRequest]) -> None:
        for r in requests:
            setattr(r, field, value)

    return change


_field_case(
    "push.version", "version", _set("version", -1), "looprl.weightsync.v1.PushShardsRequest.version", ">= 0"
)
_field_case(
    "push.world_size",
    "trainer_world_size",
    _set("trainer_world_size", 0),
    "looprl.weightsync.v1.PushShardsRequest.trainer_world_size",
    ">= 1",
)
_field_case(
    "push.rank",
    "trainer_rank",
    _set("trainer_rank", 3),
    "looprl.weightsync.v1.PushShardsRequest.trainer_rank",
    "in [0, trainer_world_size)",
)


def _short_data(requests: list[pb.PushShardsRequest]) -> None:
    requests[0].shards[0].data = requests[0].shards[0].data[:-4]


_field_case(
    "push.data_length",
    "data",
    _short_data,
    "looprl.weightsync.v1.ShardChunk.data",
    "rows x the row's elements x the dtype's size",
)


@contract.case(
    "push.empty_stream",
    "PushShards",
    "a stream without a message is refused",
    "INVALID_ARGUMENT",
    "looprl.weightsync.v1.WeightSyncService.PushShards",
    "A stream without a message: INVALID_ARGUMENT",
)
def _empty(s: Session) -> None:
    s.refused("INVALID_ARGUMENT", lambda: _push(s, []))


@contract.case(
    "push.checksum_required",
    "PushShards",
    "a chunk without hash64 is refused",
    "INVALID_ARGUMENT",
    "looprl.weightsync.v1.ShardChunk.hash64",
    "required",
)
def _no_checksum(s: Session) -> None:
    s.refused("INVALID_ARGUMENT", lambda: _push(s, _version(s, 0, checksums=False)))


@contract.case(
    "push.checksum_mismatch",
    "PushShards",
    "a chunk whose bytes do not match its hash64 is refused, and that version does not complete",
    "DATA_LOSS",
    "looprl.weightsync.v1.ShardChunk.hash64",
    "DATA_LOSS, and the version does not complete",
)
def _mismatch(s: Session) -> None:
    s.refused("DATA_LOSS", lambda: _push(s, _version(s, 0, corrupt=True)))
    latest = _latest(s).latest_version
    check(latest == -1, f"latest_version is {latest} after the only push of the run was corrupt")


@contract.case(
    "push.complete",
    "PushShards",
    "a version completes once every trainer rank pushed it, and becomes the run's latest",
    "OK",
    "looprl.weightsync.v1.PushShardsResponse.version_complete",
    "every trainer rank has pushed the version completely",
)
def _complete(s: Session) -> None:
    first = _push(s, _version(s, 0, rank=0, world_size=2))
    check(
        first.version == 0 and not first.version_complete,
        f"after rank 0 of 2: version {first.version}, complete={first.version_complete}",
    )
    check(_latest(s).latest_version == -1, "version 0 is the latest before rank 1 pushed it")
    second = _push(s, _version(s, 0, rank=1, world_size=2))
    check(second.version_complete, "version 0 is not complete after both ranks pushed it")
    latest = _latest(s)
    check(
        latest.latest_version == 0 and latest.latest_bytes_held,
        f"latest_version {latest.latest_version}, bytes held {latest.latest_bytes_held}",
    )
    s.facts["pushed"] = 0


@contract.case(
    "push.not_newer",
    "PushShards",
    "a version not newer than the run's latest is refused naming `version`",
    "FAILED_PRECONDITION",
    "looprl.weightsync.v1.PushShardsRequest.version",
    "not newer than the run's latest complete version: FAILED_PRECONDITION",
)
def _not_newer(s: Session) -> None:
    s.need("pushed", "no version completed (weight-sync.push.complete)")
    s.refused("FAILED_PRECONDITION", lambda: _push(s, _version(s, 0)), naming="version")


def _target(s: Session, address: str, transport: str = "") -> pb.RegisterTargetRequest:
    return pb.RegisterTargetRequest(
        deployment=s.facts["deployment"],
        layout=pb.TargetLayout(tensor_parallel=1, naming="hf", dtype=common_pb2.D_TYPE_FLOAT32),
        ranks=[pb.TargetRank(rank=0, address=address, replica=s.facts["deployment"] + "-r0")],
        every_k_versions=1,
        run_id=s.facts["run"],
        weight_transport=transport,
    )


@contract.case(
    "register.transport",
    "RegisterTarget",
    "a weight_transport weight-sync does not know is refused naming it",
    "INVALID_ARGUMENT",
    "looprl.weightsync.v1.RegisterTargetRequest.weight_transport",
    "refused with INVALID_ARGUMENT naming this field",
)
def _transport(s: Session) -> None:
    request = _target(s, "127.0.0.1:1", transport="carrier-pigeon")
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("RegisterTarget", request, pb.RegisterTargetResponse),
        naming="weight_transport",
    )


@contract.case(
    "register.delivers_latest",
    "RegisterTarget",
    "a newly registered target is sent the latest version, byte for byte, and reported at it",
    "OK",
    "looprl.weightsync.v1.RegisterTargetResponse.current_version",
    "delivered to the target next",
)
def _register(s: Session) -> None:
    s.need("pushed", "no version completed (weight-sync.push.complete)")
    receiver = Receiver(
        s.facts["model"],
        s.target.credentials,
        s.option("receiver_identity", "inference-router"),
        s.option("receiver_host", "127.0.0.1"),
    )
    s.facts["receiver"] = receiver
    address = receiver.start()
    reply = s.unary("RegisterTarget", _target(s, address), pb.RegisterTargetResponse)
    s.facts["registered"] = True
    check(reply.current_version == 0, f"current_version {reply.current_version}, the run's latest is 0")
    check(
        receiver.wait_version(0, DELIVERY_S), f"the target did not receive version 0 within {DELIVERY_S:.0f}s"
    )
    wrong = receiver.mismatched(0)
    check(not wrong, f"delivered bytes differ from the pushed ones: {wrong[:4]}")
    _wait_reported(s, 0)


def _wait_reported(s: Session, version: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        targets = {t.deployment: t for t in _latest(s).targets}
        target = targets.get(s.facts["deployment"])
        if target is not None and target.version >= version:
            return
        time.sleep(0.1)
    check(False, f"GetVersion does not report the target at version {version}")


@contract.case(
    "push.delivers_every_version",
    "PushShards",
    "each completed version reaches every registered target of its run",
    "OK",
    "looprl.weightsync.v1.WeightSyncService.RegisterTarget",
    "receives every version of its run",
)
def _next(s: Session) -> None:
    receiver = s.need("receiver", "no target was registered (weight-sync.register.delivers_latest)")
    _push(s, _version(s, 1))
    check(
        receiver.wait_version(1, DELIVERY_S),
        f"version 1 did not reach the target within {DELIVERY_S:.0f}s (it serves {receiver.version})",
    )
    wrong = receiver.mismatched(1)
    check(not wrong, f"delivered bytes differ from the pushed ones: {wrong[:4]}")
    _wait_reported(s, 1)
    s.facts["pushed"] = 1


@contract.case(
    "request_sync.latest",
    "RequestSync",
    "a registered target asking for the latest version is told which it will receive",
    "OK",
    "looprl.weightsync.v1.RequestSyncResponse.version",
    "The version that will be delivered",
)
def _request_sync(s: Session) -> None:
    s.need("registered", "no target was registered (weight-sync.register.delivers_latest)")
    reply = s.unary(
        "RequestSync", pb.RequestSyncRequest(deployment=s.facts["deployment"]), pb.RequestSyncResponse
    )
    check(
        reply.version == s.facts["pushed"],
        f"RequestSync answered {reply.version}, the latest is {s.facts['pushed']}",
    )


@contract.case(
    "request_sync.unknown",
    "RequestSync",
    "a deployment that is not registered is refused naming `deployment`",
    "NOT_FOUND",
    "looprl.weightsync.v1.RequestSyncRequest.deployment",
    "not registered: NOT_FOUND",
)
def _request_sync_unknown(s: Session) -> None:
    request = pb.RequestSyncRequest(deployment="conformance-never-registered")
    s.refused(
        "NOT_FOUND", lambda: s.unary("RequestSync", request, pb.RequestSyncResponse), naming="deployment"
    )


@contract.case(
    "unregister.forgets",
    "UnregisterTarget",
    "an unregistered target receives no version again, and unregistering it again is NOT_FOUND",
    "NOT_FOUND",
    "looprl.weightsync.v1.UnregisterTargetRequest.deployment",
    "not registered: NOT_FOUND",
)
def _unregister(s: Session) -> None:
    receiver = s.need("receiver", "no target was registered (weight-sync.register.delivers_latest)")
    deployment = s.facts["deployment"]
    s.unary(
        "UnregisterTarget", pb.UnregisterTargetRequest(deployment=deployment), pb.UnregisterTargetResponse
    )
    s.facts["registered"] = False
    served = receiver.version
    _push(s, _version(s, s.facts["pushed"] + 1))
    time.sleep(1.0)
    check(receiver.version == served, f"the unregistered target received version {receiver.version}")
    s.refused(
        "NOT_FOUND",
        lambda: s.unary(
            "UnregisterTarget", pb.UnregisterTargetRequest(deployment=deployment), pb.UnregisterTargetResponse
        ),
        naming="deployment",
    )
    s.refused(
        "INVALID_ARGUMENT",
        lambda: s.unary("UnregisterTarget", pb.UnregisterTargetRequest(), pb.UnregisterTargetResponse),
        naming="deployment",
    )
