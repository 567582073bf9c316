"""The mathx package."""
