"""Who runs where, and when: the lease queue (exactly N), nodes and breakers, limits, costs, routing."""
