"""The checkpoint format: what each file of a checkpoint holds."""
