"""The csvlite package."""
