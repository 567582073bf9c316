"""Weight-sync: takes trainer pushes, plans reshards and delivers each version to its deployments
(service.py wires it; transport/ holds how bytes reach a replica)."""
