"""python -m memsnap.cli: memsnapctl."""

from memsnap.cli import main

if __name__ == "__main__":  # (not when imported: tests/helpers.py imports every module before dropping root)
    main()
