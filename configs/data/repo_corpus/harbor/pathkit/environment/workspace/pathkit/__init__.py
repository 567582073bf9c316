"""The pathkit package."""
