"""The textkit package."""
