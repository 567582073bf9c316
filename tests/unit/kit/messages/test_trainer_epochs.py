"""Which trainer epoch vouches for which step records (services/kit/messages/trainer_epochs.py)."""

from services.kit.messages.trainer_epochs import Epoch, vouches

# Started at 0, resumed at 10 after a crash, ranks recreated at 25.
EPOCHS = [Epoch("a", 0), Epoch("b", 10), Epoch("c", 25)]


def test_an_epoch_vouches_for_the_steps_no_later_epoch_trains_again() -> None:
    assert vouches(EPOCHS, "a", 0) and vouches(EPOCHS, "a", 9)
    assert not vouches(EPOCHS, "a", 10)  # b retrains step 10: a's record of it is stale
    assert vouches(EPOCHS, "b", 24) and not vouches(EPOCHS, "b", 25)
    assert vouches(EPOCHS, "c", 25) and vouches(EPOCHS, "c", 10_000)  # the newest: every step ahead


def test_an_unknown_or_missing_epoch_vouches_for_nothing() -> None:
    assert not vouches(EPOCHS, "forged", 3)
    assert not vouches(EPOCHS, "", 3)
    assert not vouches([], "a", 0)
