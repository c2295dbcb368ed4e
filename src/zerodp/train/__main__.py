"""`python -m zerodp.train [options]`, the same as `zerodp train [options]`."""

from zerodp.train.launch import main

if __name__ == "__main__":
    main()
