"""Wire formats only: bytes in, values out. No I/O happens in this package."""
