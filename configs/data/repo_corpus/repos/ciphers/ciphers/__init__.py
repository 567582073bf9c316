"""The ciphers package."""
