"""The test suite, a package: its helpers are `tests.helpers.*`, so that no module of the suite is a
top-level name on sys.path that could hide an installed library (tests/test_shadowing.py)."""
