"""The grid package."""
