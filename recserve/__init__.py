"""recserve: recommendation serving (see ../shared/DESIGN.md)."""

__version__ = "0.1.0"
