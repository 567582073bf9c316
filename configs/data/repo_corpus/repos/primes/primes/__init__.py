"""The primes package."""
