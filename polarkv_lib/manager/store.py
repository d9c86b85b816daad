"""Write-behind metadata stores: SQLite (embedded default) and PostgreSQL (asyncpg).

The manager never waits on these while serving. It marks what changed; a background
task collects the current state of every changed key or node every flush interval and
writes it in one batch (upserts and deletes), so a burst of changes to one key costs one
row write. The loss window after a crash is therefore one flush interval plus the time
of one write (documented in docs/OPERATIONS.md). If the store is down, the batch is kept
and retried with backoff; changes made meanwhile merge into it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import sqlite3
import urllib.parse
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from polarkv_lib.errors import ConfigError
from polarkv_lib.keys import split_ident
from polarkv_lib.manager.rows import (
    ENTRY_COLUMNS,
    ENTRY_KEY,
    NODE_COLUMNS,
    Batch,
    EntryRow,
    NodeRow,
)

_SCHEMA = [
    """CREATE TABLE IF NOT EXISTS polarkv_nodes (
        node_id TEXT PRIMARY KEY, incarnation BIGINT NOT NULL, address TEXT NOT NULL,
        capacity BIGINT NOT NULL, disk_capacity BIGINT NOT NULL, shm_path TEXT NOT NULL,
        host_id TEXT NOT NULL, transports TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS polarkv_entries (
        tenant TEXT NOT NULL DEFAULT '', key TEXT NOT NULL, node_id TEXT NOT NULL,
        incarnation BIGINT NOT NULL, size BIGINT NOT NULL, checksum TEXT NOT NULL,
        mem_offset BIGINT NOT NULL, mem_extent BIGINT NOT NULL, in_memory BOOLEAN NOT NULL,
        on_disk BOOLEAN NOT NULL, file_bytes BIGINT NOT NULL, created DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (tenant, key))""",
]
# Tables from before tenants were persisted (key alone the primary key): their rows are
# the default tenant's.
_V1_COLUMNS = [c for c in ENTRY_COLUMNS if c != "tenant"]
_MIGRATE_SQLITE = [
    "ALTER TABLE polarkv_entries RENAME TO polarkv_entries_v1",
    _SCHEMA[1],
    f"INSERT INTO polarkv_entries ({', '.join(_V1_COLUMNS)}) "
    f"SELECT {', '.join(_V1_COLUMNS)} FROM polarkv_entries_v1",
    "DROP TABLE polarkv_entries_v1",
]
_MIGRATE_POSTGRES = [
    "ALTER TABLE polarkv_entries ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE polarkv_entries DROP CONSTRAINT polarkv_entries_pkey",
    "ALTER TABLE polarkv_entries ADD PRIMARY KEY (tenant, key)",
]


def _upsert(
    table: str, columns: tuple[str, ...], conflict: tuple[str, ...], placeholder: str
) -> str:
    marks = ", ".join(placeholder.format(i + 1) for i in range(len(columns)))
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in conflict)
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}) "
        f"ON CONFLICT ({', '.join(conflict)}) DO UPDATE SET {updates}"
    )


# Statements in the rows' column order (rows.py): a batch's rows are their parameters.
_NODE_UPSERT_SQLITE = _upsert("polarkv_nodes", NODE_COLUMNS, NODE_COLUMNS[:1], "?")
_ENTRY_UPSERT_SQLITE = _upsert("polarkv_entries", ENTRY_COLUMNS, ENTRY_KEY, "?")
_ENTRY_DELETE_SQLITE = "DELETE FROM polarkv_entries WHERE tenant = ? AND key = ?"
# SQLite writes many rows per statement: one statement per row cost twice the CPU (an
# evicting allocation changes two rows, so at a few hundred a second the store's thread
# took a core's tenth) and took the GIL back from the loop twice per row.
ROWS_PER_STATEMENT = 256


def _upsert_rows_sqlite(rows: int) -> str:
    """The entry upsert for `rows` rows in one statement."""
    one = "(" + ", ".join("?" * len(ENTRY_COLUMNS)) + ")"
    head, _, tail = _ENTRY_UPSERT_SQLITE.partition(f"VALUES {one}")
    return f"{head}VALUES {', '.join([one] * rows)}{tail}"


def _delete_rows_sqlite(rows: int) -> str:
    """The deletion of `rows` keys of one tenant in one statement (the primary key's index
    serves `tenant = ? AND key IN (...)`)."""
    return f"DELETE FROM polarkv_entries WHERE tenant = ? AND key IN ({', '.join('?' * rows)})"


def _deleted_by_tenant(batch: Batch) -> dict[str, list[str]]:
    by_tenant: dict[str, list[str]] = {}
    for tenant, key in _deleted(batch):
        by_tenant.setdefault(tenant, []).append(key)
    return by_tenant


_NODE_UPSERT_POSTGRES = _upsert("polarkv_nodes", NODE_COLUMNS, NODE_COLUMNS[:1], "${}")
_ENTRY_UPSERT_POSTGRES = _upsert("polarkv_entries", ENTRY_COLUMNS, ENTRY_KEY, "${}")
_IN_MEMORY, _ON_DISK = ENTRY_COLUMNS.index("in_memory"), ENTRY_COLUMNS.index("on_disk")


def _entry_row(r: Any) -> EntryRow:
    """A selected row (columns in ENTRY_COLUMNS' order); SQLite's booleans are ints."""
    values = list(r)
    values[_IN_MEMORY], values[_ON_DISK] = bool(values[_IN_MEMORY]), bool(values[_ON_DISK])
    return EntryRow._make(values)


def _deleted(batch: Batch) -> list[tuple[str, str]]:
    """The (tenant, key) of every deleted entry."""
    return [split_ident(ident) for ident in batch.deleted_keys]


class MetadataStore(ABC):
    @abstractmethod
    async def open(self) -> None:
        """Connect and create the schema. Raises ConfigError if it cannot."""

    @abstractmethod
    async def load(self) -> tuple[list[NodeRow], list[EntryRow]]:
        """Everything persisted, for a manager that starts again."""

    @abstractmethod
    async def write(self, batch: Batch) -> None:
        """Apply one batch atomically. Raises on failure (the caller retries)."""

    @abstractmethod
    async def close(self) -> None: ...


class SqliteStore(MetadataStore):
    """SQLite in WAL mode, used from one dedicated thread (never on the event loop)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polarkv-sqlite")
        self._db: sqlite3.Connection | None = None
        self._chunk = 1  # rows per statement (ROWS_PER_STATEMENT within SQLite's limit)
        self._upsert_chunk = self._delete_chunk = ""

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _open(self) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        for statement in _SCHEMA:
            self._db.execute(statement)
        variables = self._db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        self._chunk = max(1, min(ROWS_PER_STATEMENT, variables // len(ENTRY_COLUMNS)))
        self._upsert_chunk = _upsert_rows_sqlite(self._chunk)
        self._delete_chunk = _delete_rows_sqlite(self._chunk)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(polarkv_entries)")}
        if "tenant" not in columns:
            self._db.execute("BEGIN")
            for statement in _MIGRATE_SQLITE:
                self._db.execute(statement)
            self._db.execute("COMMIT")

    async def open(self) -> None:
        try:
            await self._run(self._open)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(
                f"manager.metadata_url: cannot open sqlite {self.path}: {exc}"
            ) from None

    def _load(self) -> tuple[list[NodeRow], list[EntryRow]]:
        assert self._db is not None
        nodes = [
            NodeRow(*row)
            for row in self._db.execute(f"SELECT {', '.join(NODE_COLUMNS)} FROM polarkv_nodes")
        ]
        entries = [
            _entry_row(r)
            for r in self._db.execute(f"SELECT {', '.join(ENTRY_COLUMNS)} FROM polarkv_entries")
        ]
        return nodes, entries

    async def load(self) -> tuple[list[NodeRow], list[EntryRow]]:
        result: tuple[list[NodeRow], list[EntryRow]] = await self._run(self._load)
        return result

    def _write(self, batch: Batch) -> None:
        assert self._db is not None
        db = self._db
        db.execute("BEGIN")
        try:
            db.executemany(_NODE_UPSERT_SQLITE, batch.nodes)  # rows are their tuples
            n = self._chunk
            rows = batch.entries
            whole = len(rows) - len(rows) % n
            for i in range(0, whole, n):
                db.execute(self._upsert_chunk, list(itertools.chain.from_iterable(rows[i : i + n])))
            db.executemany(_ENTRY_UPSERT_SQLITE, rows[whole:])
            for tenant, keys in _deleted_by_tenant(batch).items():
                whole = len(keys) - len(keys) % n
                for i in range(0, whole, n):
                    db.execute(self._delete_chunk, [tenant, *keys[i : i + n]])
                db.executemany(_ENTRY_DELETE_SQLITE, [(tenant, k) for k in keys[whole:]])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    async def write(self, batch: Batch) -> None:
        await self._run(self._write, batch)

    async def close(self) -> None:
        if self._db is not None:
            await self._run(self._db.close)
        self._pool.shutdown(wait=True)


class PostgresStore(MetadataStore):
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._pool: Any = None

    async def open(self) -> None:
        try:
            import asyncpg
        except ImportError:
            raise ConfigError(
                "manager.metadata_url: postgresql needs asyncpg (pip install 'polarkv[postgres]')"
            ) from None
        try:
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=1, max_size=2, timeout=5, command_timeout=10
            )
            async with self._pool.acquire() as conn:
                schema = _search_path_schema(self.dsn)
                if schema:  # e.g. one schema per manager shard in one database
                    await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                for statement in _SCHEMA:
                    await conn.execute(statement)
                migrated = await conn.fetchval(
                    "SELECT count(*) FROM information_schema.columns WHERE table_schema = "
                    "current_schema() AND table_name = 'polarkv_entries' AND column_name = 'tenant'"
                )
                if not migrated:
                    async with conn.transaction():
                        for statement in _MIGRATE_POSTGRES:
                            await conn.execute(statement)
        except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
            raise ConfigError(f"manager.metadata_url: cannot use PostgreSQL: {exc}") from None

    async def load(self) -> tuple[list[NodeRow], list[EntryRow]]:
        async with self._pool.acquire() as conn:
            nodes = [
                NodeRow(*r)
                for r in await conn.fetch(f"SELECT {', '.join(NODE_COLUMNS)} FROM polarkv_nodes")
            ]
            entries = [
                _entry_row(r)
                for r in await conn.fetch(f"SELECT {', '.join(ENTRY_COLUMNS)} FROM polarkv_entries")
            ]
        return nodes, entries

    async def write(self, batch: Batch) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            if batch.nodes:
                await conn.executemany(_NODE_UPSERT_POSTGRES, batch.nodes)
            if batch.entries:
                await conn.executemany(_ENTRY_UPSERT_POSTGRES, batch.entries)
            if batch.deleted_keys:
                tenants, keys = zip(*_deleted(batch), strict=True)
                await conn.execute(
                    "DELETE FROM polarkv_entries WHERE (tenant, key) IN "
                    "(SELECT * FROM unnest($1::text[], $2::text[]))",
                    list(tenants),
                    list(keys),
                )

    async def close(self) -> None:
        if self._pool is not None:
            try:
                await asyncio.wait_for(self._pool.close(), 5)
            except (TimeoutError, OSError):
                self._pool.terminate()


def _search_path_schema(dsn: str) -> str:
    """The first schema of a `?search_path=` in the URL (asyncpg passes it to the server
    as a setting, so the tables are made and used there); '' if none."""
    values = urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query).get("search_path", [])
    schema = values[0].split(",")[0].strip() if values else ""
    if schema and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema):
        raise ConfigError(
            f"manager.metadata_url: search_path {schema!r} is not a plain schema name"
        )
    return schema


def open_store(url: str) -> MetadataStore:
    if url.startswith("sqlite:///"):
        return SqliteStore(url[len("sqlite:///") :] or "polarkv-meta.db")
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresStore(url)
    raise ConfigError(f"manager.metadata_url: unsupported store {url!r}")
