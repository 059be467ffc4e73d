"""Composition and validation: Hydra overrides into an ``ExperimentConfig``, checked into a ``Plan``."""
