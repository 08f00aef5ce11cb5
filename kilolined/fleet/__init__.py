"""The fleet (docs/FLEET.md): pools of rented spot GPUs kept at their size, or following the
queue between ``min`` and ``max``.

``decide`` is the pure policy (what to rent, resume, stop, destroy, add) with time passed in;
``simulate`` runs it over a day of simulated traffic; ``provider`` the small interface every GPU
market is spoken through; ``vastai`` and ``runpod`` its two wire formats; ``loop`` the I/O that
measures the queue, asks the providers, probes new instances and applies decisions to the
Runtime.
"""
