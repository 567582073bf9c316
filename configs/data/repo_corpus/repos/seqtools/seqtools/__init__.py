"""The seqtools package."""
