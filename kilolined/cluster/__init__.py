"""Cluster mode: several gateways sharing their leases through Redis (docs/CLUSTER.md)."""
