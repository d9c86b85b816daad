"""A memory VM's process: the slab buffer, its data server and (later) its disk role."""
