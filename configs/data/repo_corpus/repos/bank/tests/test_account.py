import pytest

from bank.account import Account


def test_deposit():
    account = Account()
    account.deposit(10)
    assert account.balance == 10


def test_withdraw():
    account = Account(10)
    account.withdraw(4)
    assert account.balance == 6


def test_negative_deposit_refused():
    with pytest.raises(ValueError):
        Account().deposit(-1)
