"""The rle package."""
