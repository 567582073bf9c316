"""The statskit package."""
