"""The wordfreq package."""
