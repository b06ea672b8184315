"""The library version, importable from every layer without importing the package's API."""

__version__ = "0.1.0"
