"""The ledger package."""
