"""The versions package."""
