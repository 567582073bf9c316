"""The replica-count policy shared by sandbox fleets and reward-model pools."""

import pytest

from services.kit.ray.autoscale import Autoscaler


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_scales_up_at_once_within_bounds_and_down_slowly():
    clock = Clock()
    scaler = Autoscaler(1, 4, target_queue_per_replica=2, down_after_s=5, clock=clock)
    assert scaler.desired(1, 0) == 1
    assert scaler.desired(1, 5) == 3
    assert scaler.desired(3, 100) == 4
    assert scaler.desired(4, 0) == 4  # not yet: just became idle
    clock.now = 4.9
    assert scaler.desired(4, 0) == 4
    clock.now = 5.0
    assert scaler.desired(4, 0) == 3  # one step down
    assert scaler.desired(3, 0) == 3
    clock.now = 10.0
    assert scaler.desired(3, 0) == 2
    assert scaler.desired(2, 3) == 2  # load came back: the down timer resets
    clock.now = 20.0
    assert scaler.desired(2, 3) == 2


def test_rejects_impossible_bounds():
    with pytest.raises(ValueError, match="replicas"):
        Autoscaler(3, 2)
