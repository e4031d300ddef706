"""embedding_server layer (see DESIGN.md §2)."""
