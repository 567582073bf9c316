"""The inventory package."""
