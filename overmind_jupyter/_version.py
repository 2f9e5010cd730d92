__version__ = "0.1.0"  # the package's version (pyproject reads it); tests/test_structure.py checks the others
