"""Tensor parallelism: the process group and its collectives (parallel_state), and how weights split
across ranks (sharding)."""
