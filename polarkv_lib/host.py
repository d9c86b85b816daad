"""Facts about this host that processes compare with each other."""

from __future__ import annotations

import socket


def host_id() -> str:
    """Identifies this kernel instance: a client with the same id as a slab may map its
    buffer (shm transport)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"
