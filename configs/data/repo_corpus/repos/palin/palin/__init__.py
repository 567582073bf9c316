"""The palin package."""
