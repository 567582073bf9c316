"""The searching package."""
