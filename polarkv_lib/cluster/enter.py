"""`python -m polarkv_lib.cluster.enter HOSTNAME -- COMMAND...`: name this UTS namespace
and become COMMAND.

Run as `ip netns exec NS unshare --uts -- python -m polarkv_lib.cluster.enter ...`: each
step execs the next, so the process the harness started is the one that ends up running
COMMAND (its pid is the one to signal), and the hostname it reports is its VM's, which
is what makes `transport="auto"` treat other VMs as other hosts.
"""

from __future__ import annotations

import os
import socket
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m polarkv_lib.cluster.enter HOSTNAME -- COMMAND...")
    socket.sethostname(argv[0])
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
