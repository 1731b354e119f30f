"""``python -m tether``: the command line."""

from tether.cli import main

if __name__ == "__main__":
    main()
