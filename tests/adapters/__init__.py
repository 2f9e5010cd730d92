"""Tests of the adapter gate (issue 4); a package, so that its conftest is `tests.adapters.conftest`."""
