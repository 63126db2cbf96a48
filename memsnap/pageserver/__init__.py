"""Lazy restore from the store: a CRIU page server fed by a PageSource (see restore.py and server.py)."""

from memsnap.pageserver.images import PageIndex, Pagemap, PagemapEntry, parse_pagemap
from memsnap.pageserver.server import PageServer
from memsnap.pageserver.sources import ChunkSource, DirPageSource, PageSource, SourceFailed

__all__ = ["ChunkSource", "DirPageSource", "PageIndex", "PageServer", "PageSource", "Pagemap", "PagemapEntry",
           "SourceFailed", "parse_pagemap"]
