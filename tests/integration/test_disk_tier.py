"""Tier locally: offload to and reload from the node's own disk, byte-exact, with
per-node LRU, watermarks, verified files, and no tiering byte between nodes."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

from polarkv_lib.client import PolarKVClient
from tests.conftest import Cluster, PolarKV, http, stats, wait_for
from tests.conftest import prompt as shared_prompt

MiB = 1 << 20
CT = 4  # tokens per chunk: small prompts, big chunks


def prompt(conversation: int, chunks: int) -> list[int]:
    return shared_prompt(conversation, chunks, CT)


def digest(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def file_of(disk: Path, key: str) -> Path:
    return disk / key[:2] / key[2:4] / key


class MemoryWatch:
    """Samples every node's memory use while a test runs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for node in http("GET", self.url + "/v1/nodes")[1]["nodes"]:
                self.peak[node["id"]] = max(self.peak.get(node["id"], 0), node["memory_used"])
                self.capacity[node["id"]] = node["memory_capacity"]
            self._stop.wait(0.02)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_working_set_eight_times_memory(cluster: Cluster) -> None:
    node = cluster.embedded(disk=True, slab__memory="64MiB", disk__capacity="2GiB")
    url = node.manager_url
    conversations, turns = 16, 32  # 16 conversations x 32 chunks x 1 MiB = 512 MiB
    digests: dict[int, list[str]] = {}
    with MemoryWatch(url) as watch, PolarKVClient(url, chunk_tokens=CT, timeout=10) as c:
        for conv in range(conversations):
            chunks = [os.urandom(MiB) for _ in range(turns)]
            digests[conv] = [digest(ch) for ch in chunks]
            for turn in range(4, turns + 1, 4):  # growing prefixes, as an engine stores turns
                assert c.store_kv(prompt(conv, turn), chunks[:turn]) == turn
        wait_for(lambda: stats(url)["bytes_offloading"] == 0)  # offloads report asynchronously
        s = stats(url)
        assert s["keys_memory"] + s["keys_disk"] >= conversations * turns
        assert s["offloads"] >= conversations * turns - 64 and s["evictions"] == 0
        # a second working set pushes the first one out of memory
        for conv in range(100, 104):
            assert c.store_kv(prompt(conv, 32), [os.urandom(MiB) for _ in range(32)]) == 32
        first_keys = c.keys(prompt(0, turns))
        assert all(http("GET", f"{url}/v1/keys/{k}")[1]["tiers"] == ["disk"] for k in first_keys)
        # ... and comes back byte-exact, through load_kv of its prefixes and through get
        for conv in range(conversations):
            n_tokens, views = c.load_kv(prompt(conv, turns))
            assert n_tokens == turns * CT, conv
            assert [digest(v) for v in views] == digests[conv]
        key = c.keys(prompt(3, 5))[4]
        got = c.get(key)
        assert got is not None and digest(got) == digests[3][4]
        assert c.stats.faults == 0 and c.stats.checksum_failures == 0
    s = stats(url)
    assert s["hits_disk"] > 0 and s["reloads"] > 0 and s["reload_bytes"] > 0
    assert s["misses"] == 0 and s["tier_failures"] == 0
    for node_id, peak in watch.peak.items():
        assert peak <= 0.90 * watch.capacity[node_id], (peak, watch.capacity[node_id])
    nodes = http("GET", url + "/v1/nodes")[1]["nodes"]
    assert nodes[0]["reported"]["tiering_bytes_to_other_nodes"] == 0


def _push_out(c: PolarKVClient, conv: int, chunks: int) -> None:
    assert c.store_kv(prompt(conv, chunks), [os.urandom(MiB) for _ in range(chunks)]) == chunks


def _metric(url: str, pattern: str) -> float:
    text = http("GET", url + "/metrics")[1]
    m = re.search("^" + pattern + r" ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_damaged_file_is_a_miss_never_wrong_bytes(
    cluster: Cluster, tmp_path: Path, damage: str
) -> None:
    node = cluster.embedded(disk=True, slab__memory="16MiB")
    url, disk = node.manager_url, Path(node.workdir) / "disk"
    with PolarKVClient(url, chunk_tokens=CT, timeout=5) as c:
        chunks = [os.urandom(MiB) for _ in range(4)]
        assert c.store_kv(prompt(1, 4), chunks) == 4
        _push_out(c, 2, 14)  # the first prompt goes to disk
        keys = c.keys(prompt(1, 4))
        wait_for(lambda: all(file_of(disk, k).exists() for k in keys))
        wait_for(lambda: http("GET", f"{url}/v1/keys/{keys[2]}")[1]["tiers"] == ["disk"])
        path = file_of(disk, keys[2])
        if damage == "flip":
            with open(path, "r+b") as fh:
                fh.seek(4096 + 12345)
                byte = fh.read(1)
                fh.seek(4096 + 12345)
                fh.write(bytes([byte[0] ^ 0x40]))
        elif damage == "truncate":
            os.truncate(path, 4096 + MiB // 2)
        else:
            path.unlink()
        n_tokens, views = c.load_kv(prompt(1, 4))
        assert n_tokens == 2 * CT  # the prefix stops at the damaged chunk
        assert [bytes(v) for v in views] == chunks[:2]
        assert c.stats.checksum_failures == 0  # the node caught it, the client saw a miss
    assert http("GET", f"{url}/v1/keys/{keys[2]}")[0] == 404
    assert not path.exists()
    reason = {"flip": "checksum", "truncate": "truncated", "remove": "missing"}[damage]
    assert _metric(url, f'polarkv_tier_failures_total{{op="reload",reason="{reason}"}}') == 1
    if damage == "flip":
        assert _metric(url, "polarkv_checksum_failures_total") == 1
    assert node.proc.poll() is None and http("GET", url + "/healthz")[0] == 200


def test_full_filesystem_degrades_to_eviction(cluster: Cluster, tmp_path: Path) -> None:
    small = tmp_path / "small-fs"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(small)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.fail(f"this test needs root to mount a small tmpfs: {mounted.stderr.decode()}")
    try:
        # the configured budget is far above what the filesystem can hold
        node = cluster.embedded(
            disk=True, slab__memory="16MiB", disk__paths=str(small), disk__capacity="1GiB"
        )
        url = node.manager_url
        with PolarKVClient(url, chunk_tokens=CT, timeout=5) as c:
            for conv in range(8):  # 64 MiB through 16 MiB of memory and 12 MiB of disk
                _push_out(c, conv, 8)
            s = stats(url)
            assert s["offloads"] > 0 and s["evictions"] > 0
            assert _metric(url, 'polarkv_tier_failures_total{op="offload",reason="disk_full"}') > 0
            # the newest prompt is whole; what did not fit is a miss, not an error
            assert c.load_kv(prompt(7, 8))[0] == 8 * CT
            served = sum(c.load_kv(prompt(conv, 8))[0] // CT for conv in range(8))
            assert 8 <= served < 64
            assert c.stats.faults == 0

        def files() -> list[Path]:
            return [f for f in small.rglob("*") if f.is_file() and not f.name.endswith(".tmp")]

        # once tiering has settled, the stats describe exactly the files on the disk
        wait_for(
            lambda: (
                stats(url)["bytes_offloading"] == 0
                and stats(url)["keys_disk"] == len(files())
                and stats(url)["bytes_disk"] == sum(f.stat().st_size for f in files())
            )
        )
        assert node.proc.poll() is None
        node.close()
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def _data_ports(proc: PolarKV) -> int:
    return int(proc.slab_address.rpartition(":")[2])


def test_two_nodes_never_tier_through_each_other(cluster: Cluster) -> None:
    manager = cluster.manager()
    url = manager.manager_url
    a = cluster.slab_disk(url, slab__memory="16MiB")
    b = cluster.slab_disk(url, slab__memory="16MiB")
    with PolarKVClient(url, chunk_tokens=CT, timeout=10, transport="tcp") as c:
        for conv in range(12):  # 96 MiB through 2 x 16 MiB
            _push_out(c, conv, 8)
        for conv in range(12):
            assert c.load_kv(prompt(conv, 8))[0] == 8 * CT
    wait_for(
        lambda: all(
            n["reported"].get("reloads", 0) > 0 for n in http("GET", url + "/v1/nodes")[1]["nodes"]
        )
    )
    nodes = {n["id"]: n for n in http("GET", url + "/v1/nodes")[1]["nodes"]}
    for proc in (a, b):
        reported = nodes[proc.info["node_id"]]["reported"]
        assert reported["offload_bytes"] > 0 and reported["reload_bytes"] > 0
        assert reported["tiering_bytes_to_other_nodes"] == 0
        # tiering bytes are not data-plane bytes: what the node served over tcp is what
        # clients wrote and read there, never the other node's offloads
        assert reported["data_bytes_written"] <= 12 * 8 * MiB
    # and no socket of either slab process leads to the other one's data plane
    for proc, other in ((a, b), (b, a)):
        conns = psutil.Process(proc.proc.pid).net_connections(kind="tcp")
        peers = {c.raddr.port for c in conns if c.raddr}
        assert _data_ports(other) not in peers
        manager_port = int(url.rpartition(":")[2])
        assert peers <= {manager_port} | {
            c.raddr.port for c in conns if c.raddr and c.laddr.port == _data_ports(proc)
        }


def test_striping_spreads_files_over_paths(cluster: Cluster, tmp_path: Path) -> None:
    one, two = tmp_path / "vol1", tmp_path / "vol2"
    node = cluster.embedded(disk=True, slab__memory="16MiB", disk__paths=f"{one},{two}")
    with PolarKVClient(node.manager_url, chunk_tokens=CT, timeout=5) as c:
        for conv in range(4):
            _push_out(c, conv, 8)
    url = node.manager_url

    def files(volume: Path) -> list[Path]:
        return [f for f in volume.rglob("*") if f.is_file() and not f.name.endswith(".tmp")]

    # once tiering has settled, the files on both volumes are exactly the disk entries
    wait_for(
        lambda: (
            stats(url)["keys_disk"] >= 16
            and stats(url)["bytes_offloading"] == 0
            and len(files(one)) + len(files(two)) == stats(url)["keys_disk"]
        )
    )
    in_one, in_two = files(one), files(two)
    assert len(in_one) >= 4 and len(in_two) >= 4
    assert not {f.name for f in in_one} & {f.name for f in in_two}


def test_delete_removes_the_file_and_restart_adopts_the_rest(cluster: Cluster) -> None:
    manager = cluster.manager()
    url = manager.manager_url
    slab = cluster.slab_disk(url, slab__memory="16MiB", slab__node_id="vm-1")
    disk = Path(slab.workdir) / "disk"
    with PolarKVClient(url, chunk_tokens=CT, timeout=5) as c:
        chunks = [os.urandom(MiB) for _ in range(8)]
        assert c.store_kv(prompt(1, 8), chunks) == 8
        _push_out(c, 2, 14)
        keys = c.keys(prompt(1, 8))
        wait_for(lambda: all(file_of(disk, k).exists() for k in keys))
        assert http("DELETE", f"{url}/v1/keys/{keys[7]}")[0] == 200
        wait_for(lambda: not file_of(disk, keys[7]).exists())
        slab.kill()  # kill -9: the manager forgets the node after its TTL
        wait_for(lambda: stats(url)["nodes"] == 0)
        assert c.load_kv(prompt(1, 8)) == (0, [])
        # the same VM comes back with the same disk: its verified files serve again
        cluster.start(
            ["slab", "disk"],
            {
                "slab.manager_url": url,
                "slab.memory": "16MiB",
                "slab.node_id": "vm-1",
                "disk.paths": str(disk),
            },
            name="again",
        )
        wait_for(lambda: stats(url)["keys_disk"] > 0)
        n_tokens, views = c.load_kv(prompt(1, 8))
        assert n_tokens == 7 * CT  # chunk 7 was deleted
        assert [bytes(v) for v in views] == chunks[:7]


def test_a_lease_free_lookup_says_how_much_of_the_hit_is_in_memory(cluster: Cluster) -> None:
    """What a scheduler asks before it picks how to load (vLLM's "auto" loads): the hit,
    and how many of its chunks from the first are in memory now; asking moves nothing."""
    node = cluster.embedded(disk=True, slab__memory="8MiB", disk__capacity="256MiB")
    url = node.manager_url
    with PolarKVClient(url, chunk_tokens=CT, timeout=10) as c:
        for conv in range(4):  # 4 x 4 MiB through 8 MiB of memory: the first go to disk
            assert c.store_kv(prompt(conv, 4), [os.urandom(MiB) for _ in range(4)]) == 4
        keys = c.keys(prompt(0, 4))
        wait_for(
            lambda: all(http("GET", f"{url}/v1/keys/{k}")[1]["tiers"] == ["disk"] for k in keys)
        )
        before = stats(url)
        assert c.lookup_kv_tiers(prompt(0, 4)) == (4 * CT, 0)  # on disk: a hit, none in memory
        assert c.lookup_kv_tiers(prompt(3, 4)) == (4 * CT, 4 * CT)  # the latest: all in memory
        assert c.lookup_kv_tiers(prompt(9, 4)) == (0, 0)
        # a longer prompt whose first chunks are in memory and the rest not stored
        assert c.lookup_kv_tiers([*prompt(3, 4), 1, 2, 3, 4]) == (4 * CT, 4 * CT)
        assert c.lookup_kv(prompt(0, 4)) == 4 * CT
        # nothing came back into memory for the asking (offloads of the latest prompts
        # may still finish meanwhile: the watermark's doing, not the lookups')
        assert stats(url)["reloads"] == before["reloads"]
        assert all(http("GET", f"{url}/v1/keys/{k}")[1]["tiers"] == ["disk"] for k in keys)
        assert c.load_kv(prompt(0, 4))[0] == 4 * CT  # a load does reload them
        assert stats(url)["reloads"] > before["reloads"]
