"""`polarkv bench ...`: benchmarks that put PolarKV beside a limit or a peer measured in
the same run, and report the ratio (docs/BENCHMARKS.md has each one's method and latest
results).

Rooms:

    core        arguments, rows of paired rounds (`Pairs`), table and JSON output,
                `guarded` (bench errors to exit codes)
    measure     run_threads, CpuWatch, process CPU and memory
    limits      the raw loopback-socket and memcpy limits and their buffers
    plot        bar charts as small PNGs (matplotlib, Agg)
    cli         the `bench` click group: one line per benchmark
    datapath, disk (+ disk_plan, disk_files, disk_node), load, peers (+ peers_*), manager
                one module per benchmark

Services are started with polarkv_lib/service.py (the one starter, also used by
the demo and the tests).

Adding a benchmark `foo`:

1. Write `polarkv_lib/tools/bench/foo.py` (under ~500 lines; split parts into siblings
   `foo_*.py`). Parse arguments into a frozen plan, raising `core.BadArguments`; measure
   ours and the baseline side by side per round into `Pairs` subclasses; print
   `core.markdown_table(...)`; write `core.write_json(...)` when `--json` is given; show
   progress with `polarkv_lib.progress.progress`. End it with a click command named
   `command` whose body is `core.guarded("foo", lambda: run(parse_plan(...), json_path))`,
   where `run` returns False when a byte or a measurement was wrong (exit 3).
2. Add one line to `BENCHES` in `cli.py`: `"foo": "polarkv_lib.tools.bench.foo",`.
"""
