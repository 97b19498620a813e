"""The model stages: the generic stage server and its engine loop, the three adapters, placement."""
