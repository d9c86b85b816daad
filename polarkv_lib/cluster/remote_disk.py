"""Global pools, for experiments only: a node's disk tier served by another VM.

PolarKV pairs each memory VM with its own disks so that tiering never crosses the
network. To measure what that pairing saves, the cluster harness can instead give each
memory VM's disk role a `RemoteDiskStore`: the same interface as `DiskStore`, but every
offload ships the bytes to a `serve()` process on another memory VM, which writes them
with a real `DiskStore`, and every reload fetches them back. Everything else (orders,
checksums, the manager's decisions) is unchanged, so the only difference between the
two layouts is where the tiering bytes travel. The harness selects it with
`disk.store = "polarkv_lib.cluster.remote_disk:remote_store"` and `disk.remote` (the
store registry of node/stores.py imports this module only then); it is never a default
and has no place in a deployment.

Wire format, one request at a time per connection (little-endian):
    request:  "PKRD" | op u8 | key 16 bytes | size u64 | checksum u64  [+ size payload bytes]
    response: "PKRD" | status u8 | length u64  [+ length bytes]
op: 1 offload (reply: file bytes as u64), 2 reload (reply: the payload), 3 delete
(reply: one byte, 1 if a file was deleted), 4 scan (reply: JSON list of
[key, size, checksum, file_bytes]). A refusal answers status 1 and a JSON
{"reason", "detail"} that the caller raises as the same DiskFailure.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import socketserver
import struct
import sys
import threading
import time

from polarkv_lib.config import DiskConfig, parse_address, parse_size
from polarkv_lib.errors import DiskFailure, Failure, NetworkError, OperationTimeout
from polarkv_lib.node.disk import DiskCounters, DiskStore, FileInfo
from polarkv_lib.transport.sockio import recv_exact, send_all

MAGIC = b"PKRD"
_REQ = struct.Struct("<4sB100sQQ")  # the entry's identity (keys.ident), NUL padded
_RESP = struct.Struct("<4sBQ")
_U64 = struct.Struct("<Q")
OFFLOAD, RELOAD, DELETE, SCAN = 1, 2, 3, 4
TIMEOUT = 30.0


def _recv(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), deadline)
    return buf


class RemoteDiskStore(DiskStore):
    """A DiskStore whose files live on another VM (see the module docstring). The
    bookkeeping (`files`, `used`, counters) is kept here, as DiskStore keeps it."""

    def __init__(self, remote: str, capacity: int) -> None:  # no super(): no local paths to probe
        self.paths = [f"remote://{remote}"]
        self.capacity = capacity
        self.o_direct = False
        self.used = 0
        self.files: dict[str, FileInfo] = {}
        self.counters = DiskCounters()
        self._lock = threading.Lock()
        self._remote = parse_address(remote)
        self._local = threading.local()  # one connection per I/O thread
        self._socks: set[socket.socket] = set()  # all of them, for close()

    def _exchange(
        self,
        op: int,
        key: str,
        size: int = 0,
        checksum: str = "0",
        payload: memoryview | None = None,
        into: memoryview | None = None,
    ) -> bytearray:
        """Send one request, read its reply; a refusal or any network fault raises
        DiskFailure (a network fault also drops the connection)."""
        sock: socket.socket | None = getattr(self._local, "sock", None)
        deadline = time.monotonic() + TIMEOUT
        try:
            if sock is None:
                sock = socket.create_connection(self._remote, timeout=TIMEOUT)
                sock.settimeout(None)  # blocking: sockio bounds each call by the deadline
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._local.sock = sock
                with self._lock:
                    self._socks.add(sock)
            head = _REQ.pack(MAGIC, op, key.encode(), size, int(checksum, 16))
            send_all(sock, (head,) if payload is None else (head, payload), deadline)
            magic, status, length = _RESP.unpack(_recv(sock, _RESP.size, deadline))
            if magic != MAGIC:
                raise ConnectionError("not a remote disk reply")
            if status:
                detail = json.loads(_recv(sock, length, deadline))
                raise DiskFailure(Failure(detail["reason"]), f"remote disk: {detail['detail']}")
            if into is not None:
                if length != len(into):
                    raise ConnectionError("reload reply of the wrong length")
                recv_exact(sock, into, deadline)
                return bytearray()
            return _recv(sock, length, deadline)
        except (OSError, ValueError, struct.error, NetworkError, OperationTimeout) as exc:
            if sock is not None:
                sock.close()
                with self._lock:
                    self._socks.discard(sock)
            self._local.sock = None
            raise DiskFailure(Failure.IO_ERROR, f"remote disk {self._remote}: {exc}") from None

    def close(self) -> None:
        """Close every thread's connection (a thread's next call opens a new one)."""
        with self._lock:
            socks, self._socks = self._socks, set()
        for sock in socks:
            sock.close()

    def scan(self) -> list[FileInfo]:
        rows = json.loads(self._exchange(SCAN, "0" * 32))
        found = [FileInfo(k, int(s), c, int(b)) for k, s, c, b in rows]
        with self._lock:
            self.files = {f.key: f for f in found}
            self.used = sum(f.file_bytes for f in found)
        return found

    def _write(self, key: str, region: memoryview, size: int, checksum: str) -> None:
        # DiskStore.offload reserves room and records the file around this one exchange
        _U64.unpack(self._exchange(OFFLOAD, key, size, checksum, payload=region[:size]))

    def reload(self, key: str, region: memoryview, size: int, checksum: str) -> None:
        try:
            self._exchange(RELOAD, key, size, checksum, into=region[:size])
        except DiskFailure as failure:
            if failure.reason is not Failure.IO_ERROR:
                self._forget(key)  # the server deleted a broken file
            raise
        with self._lock:
            self.counters.reloads += 1
            self.counters.reload_bytes += size

    def delete(self, key: str) -> bool:
        try:
            deleted = self._exchange(DELETE, key) == b"\x01"
        except DiskFailure:
            deleted = False
        self._forget(key)
        if deleted:
            with self._lock:
                self.counters.deletes += 1
        return deleted


def remote_store(config: DiskConfig) -> RemoteDiskStore:
    """`disk.store = "polarkv_lib.cluster.remote_disk:remote_store"`: the disk tier on the
    server at `disk.remote`."""
    return RemoteDiskStore(config.remote, config.capacity)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        store = self.server.store
        while True:
            try:
                select.select([sock], [], [])  # idle for as long as the client keeps it
                deadline = time.monotonic() + TIMEOUT  # a request, once begun, arrives in time
                head = _recv(sock, _REQ.size, deadline)
            except (OSError, NetworkError, OperationTimeout):
                return
            magic, op, raw_key, size, checksum_int = _REQ.unpack(head)
            if magic != MAGIC:
                return
            key, checksum = raw_key.rstrip(b"\0").decode(errors="replace"), f"{checksum_int:016x}"
            try:
                if op == OFFLOAD:
                    data = _recv(sock, size, deadline)
                    reply = _U64.pack(store.offload(key, memoryview(data), size, checksum))
                elif op == RELOAD:
                    out = bytearray(size)
                    store.reload(key, memoryview(out), size, checksum)
                    reply = bytes(out)
                elif op == DELETE:
                    reply = b"\x01" if store.delete(key) else b"\x00"
                elif op == SCAN:
                    reply = json.dumps(
                        [[f.key, f.size, f.checksum, f.file_bytes] for f in store.files.values()]
                    ).encode()
                else:
                    return
                send_all(
                    sock, (_RESP.pack(MAGIC, 0, len(reply)), reply), time.monotonic() + TIMEOUT
                )
            except DiskFailure as failure:
                body = json.dumps({"reason": failure.reason.value, "detail": str(failure)}).encode()
                send_all(sock, (_RESP.pack(MAGIC, 1, len(body)), body), time.monotonic() + TIMEOUT)
            except (OSError, ValueError, NetworkError, OperationTimeout):
                return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], store: DiskStore) -> None:
        super().__init__(address, _Handler)
        self.store = store


def main(argv: list[str]) -> None:
    """`python -m polarkv_lib.cluster.remote_disk --listen HOST:PORT --path DIR
    --capacity SIZE [--ready-file F]`: serve a DiskStore to one remote disk role."""
    parser = argparse.ArgumentParser(prog="polarkv_lib.cluster.remote_disk")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--capacity", default="2GiB")
    parser.add_argument("--ready-file", default="")
    args = parser.parse_args(argv)
    store = DiskStore((args.path,), parse_size(args.capacity), o_direct=False)
    store.scan()
    server = _Server(parse_address(args.listen), store)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as fh:
            json.dump({"pid": os.getpid(), "listen": args.listen}, fh)
        os.replace(args.ready_file + ".tmp", args.ready_file)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main(sys.argv[1:])
