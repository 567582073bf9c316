"""services/kit/ray/head_loss.py without a Ray head: which addresses are watched, and a head that
answers again after a blip. The loss itself, with real heads, is tests/integration/kit/test_ray_head_loss.py."""

from __future__ import annotations


def test_the_same_head_answering_again_is_a_blip_not_a_loss(monkeypatch):
    from services.kit.ray import head_loss as ray_head

    def no_restart(environ):
        raise AssertionError("restarted for a head that came back")

    monkeypatch.setattr(ray_head, "_joined", ray_head._Joined())
    monkeypatch.setattr(ray_head, "_head_ready", lambda address: "c1")
    monkeypatch.setattr(ray_head, "restart_process", no_restart)
    ray_head._joined.address, ray_head._joined.cluster_id = "127.0.0.1:1", "c1"
    ray_head._joined.environ, ray_head._joined.lost = {}, "the Ray head at 127.0.0.1:1 is unreachable"
    ray_head._rejoin()
    assert ray_head._joined.lost == ""


def test_only_a_heads_address_is_watched(monkeypatch):
    from services.kit.ray import head_loss as ray_head

    monkeypatch.setattr(ray_head, "_joined", ray_head._Joined())
    for address in ("ray://head:10001", "auto", "head"):
        ray_head.joined(address)
        assert ray_head._joined.address == "" and ray_head.head_lost() == ""
