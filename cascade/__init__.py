"""cascade layer (see docs/architecture.md §2)."""
