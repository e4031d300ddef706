"""ranker layer (see DESIGN.md §2)."""
