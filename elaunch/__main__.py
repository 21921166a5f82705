"""``python -m elaunch`` → the click command."""

from elaunch.cli import main

if __name__ == "__main__":
    main()
