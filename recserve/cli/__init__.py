"""cli layer (see DESIGN.md §2)."""
