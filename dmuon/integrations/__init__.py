"""Optional integrations with other training frameworks (each imports its framework)."""

__all__ = []
