"""Helpers shipped for tests: tiny models, conformance checks, strategies."""
