"""bench layer (see DESIGN.md §2)."""
