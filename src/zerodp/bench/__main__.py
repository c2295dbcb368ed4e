"""`python -m zerodp.bench [options]`, the same as `zerodp bench [options]`; the driver also starts
each mode's worker process this way (with --worker MODE)."""

from zerodp.bench.driver import main

if __name__ == "__main__":
    main()
