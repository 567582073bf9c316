"""gRPC: the server bootstrap, interceptors, status errors, the authorization table, mutual
TLS identities and raw-bytes request handlers.
"""
