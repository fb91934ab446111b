"""The built-in demo: a small model on synthetic data, trained with DDP on CPU."""
