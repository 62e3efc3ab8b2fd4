"""The package version (its own module, so modules below the package can use it)."""
__version__ = "0.1.0"

__all__ = ["__version__"]
