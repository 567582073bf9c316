"""The thermo package."""
