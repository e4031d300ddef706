"""rpc layer (see DESIGN.md §2)."""
