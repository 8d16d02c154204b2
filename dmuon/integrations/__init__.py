"""Optional integrations with other training frameworks (each imports its framework)."""
