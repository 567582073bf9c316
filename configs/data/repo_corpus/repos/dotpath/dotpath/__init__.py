"""The dotpath package."""
