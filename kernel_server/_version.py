__version__ = "0.1.0"  # the same as overmind_jupyter's: tests/test_structure.py checks it
