"""Draining a node (`POST /v1/nodes/{id}/drain`, `polarkv admin drain`): before an
operator stops a memory node, its memory empties without losing what has a disk copy.

A draining node gets no new memory extents: no placements, no reloads (a lookup that
reaches one of its disk-only entries misses). Each tiering plan then moves its memory
entries out: a clean entry (its file is valid) drops its memory copy at no cost, a
memory-only entry is offloaded to the node's own disk (and leaves memory when the
offload reports back), and on a node without a disk role the entry is dropped. Entries
under a read lease wait for it to end (they are out of the eviction order until then). The node is drained when it holds no memory
entry and no offload is pending; it can then be stopped, and when it starts again it
reports its files, which serve hits again. A drain ends with the node's incarnation
(a restarted node registers afresh), and it is not persisted.
"""

from __future__ import annotations

from typing import Any

from polarkv_lib.manager.model import Claim, Node, Residency
from polarkv_lib.manager.tiering import Tiering


class Draining(Tiering):
    def drain(self, node_id: str) -> dict[str, Any] | None:
        """Start (or look at) the drain of a live node; None: no such live node."""
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            return None
        node.draining = True
        self._plan_drain(node)
        return self.drain_view(node)

    @staticmethod
    def drain_view(node: Node) -> dict[str, Any]:
        pending = len(node.offloads)
        return {
            "node": node.node_id,
            "draining": node.draining,
            "keys_memory": node.keys_memory,
            "offloads_pending": pending,
            "keys_disk": len(node.disk_lru),
            "drained": not node.keys_memory and not pending,
        }

    def plan_tiering(self) -> list[str]:
        touched = set(super().plan_tiering())
        for node in self.nodes.values():
            if node.alive and node.draining and node.lru:
                before = len(node.orders)
                self._plan_drain(node)
                if len(node.orders) > before:
                    touched.add(node.node_id)
        return sorted(touched)

    def _alloc_on(
        self, node: Node, size: int, claim: Claim, make_room: bool = True
    ) -> tuple[int, int] | None:
        # Every new memory extent (placement or reload) comes through here.
        if node.draining:
            return None
        return super()._alloc_on(node, size, claim, make_room)

    def _plan_drain(self, node: Node) -> None:
        # The order holds no read or in-flight entry: those follow when they come back.
        for entry in list(node.lru.values()):
            if entry.residency is Residency.BOTH:
                self._release_memory_copy(entry)
            elif node.has_disk and self._disk_room(node, entry.size):
                self._start_offload(node, entry)
            else:  # no disk, or a full one: the entry goes
                self._drop(entry)
                self.counters.evictions += 1
