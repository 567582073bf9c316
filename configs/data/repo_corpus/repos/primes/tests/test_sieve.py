from primes.sieve import is_prime, primes_up_to


def test_small_primes():
    assert primes_up_to(10) == [2, 3, 5, 7]


def test_is_prime():
    assert is_prime(97) and not is_prime(91)
