"""Contracts only: protocols, predicates and abstract bases, no MLX-heavy code."""
