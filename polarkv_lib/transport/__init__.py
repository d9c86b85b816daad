"""Client-side data-plane transports behind one interface: tcp, shm (and rdma later)."""
