"""The spans package."""
