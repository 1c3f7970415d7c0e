"""`python -m clients.bench` (what `kvserve bench` runs): the load generator of clients/bench/load.py."""

from clients.bench.load import main

if __name__ == "__main__":
    raise SystemExit(main())
