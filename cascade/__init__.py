"""cascade layer (see DESIGN.md §2)."""
