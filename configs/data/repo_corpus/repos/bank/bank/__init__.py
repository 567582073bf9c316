"""The bank package."""
