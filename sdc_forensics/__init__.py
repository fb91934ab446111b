"""sdc-forensics: find silent data corruption in data-parallel PyTorch training."""

__version__ = "0.1.0"

__all__ = ["__version__"]
