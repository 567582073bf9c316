"""Prime numbers."""


def primes_up_to(n):
    """Every prime p with p <= n."""
    if n < 2:
        return []
    is_prime = [True] * (n + 1)
    is_prime[0] = is_prime[1] = False
    for p in range(2, int(n**0.5) + 1):
        if is_prime[p]:
            for multiple in range(p * p, n + 1, p):
                is_prime[multiple] = False
    return [p for p in range(2, n) if is_prime[p]]


def is_prime(n):
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))
