"""python -m memsnap.cli: memsnapctl."""

from memsnap.cli import main

main()
