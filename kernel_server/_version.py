from overmind_jupyter._version import __version__

__all__ = ["__version__"]
