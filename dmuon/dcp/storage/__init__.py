"""Where a checkpoint's bytes live: the store interface and its backends."""
