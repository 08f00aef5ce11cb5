"""Self-healing fleet (docs/FLEET.md): pools of rented spot GPUs kept at their size.

``decide`` is the pure policy (what to rent, destroy, add) with time passed in; ``provider``
the small interface every GPU market is spoken through; ``vastai`` and ``runpod`` its two wire
formats; ``loop`` the I/O that asks the providers, probes new instances and applies decisions
to the Runtime.
"""
