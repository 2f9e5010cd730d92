"""What the tests share: kernels, snippets, tiny models, fault-injection loaders, the browser harness.

Some of these also run as processes of their own (`python -m tests.helpers.units_worker ...`), with the
repository's root on PYTHONPATH (tests/conftest.py puts it there for every process a test starts).
"""
