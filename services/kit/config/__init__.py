"""Configuration: the schema's building blocks, run recipes, service configs from the
environment, the cluster limits and the table of services.
"""
