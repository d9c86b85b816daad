"""`polarkv replay`: Mooncake-format traces replayed against PolarKV (see cli.py)."""
