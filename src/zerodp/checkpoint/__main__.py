"""`python -m zerodp.checkpoint DIR OUT`, the same as `zerodp consolidate DIR OUT`."""

from zerodp.checkpoint.command import main

if __name__ == "__main__":
    main()
