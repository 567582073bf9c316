"""The fizz package."""
