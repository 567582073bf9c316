"""The retrying package."""
