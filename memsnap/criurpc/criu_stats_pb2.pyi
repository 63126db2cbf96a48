from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DumpStatsEntry(_message.Message):
    __slots__ = ("freezing_time", "frozen_time", "memdump_time", "memwrite_time", "pages_scanned", "pages_skipped_parent", "pages_written", "irmap_resolve", "pages_lazy")
    FREEZING_TIME_FIELD_NUMBER: _ClassVar[int]
    FROZEN_TIME_FIELD_NUMBER: _ClassVar[int]
    MEMDUMP_TIME_FIELD_NUMBER: _ClassVar[int]
    MEMWRITE_TIME_FIELD_NUMBER: _ClassVar[int]
    PAGES_SCANNED_FIELD_NUMBER: _ClassVar[int]
    PAGES_SKIPPED_PARENT_FIELD_NUMBER: _ClassVar[int]
    PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    IRMAP_RESOLVE_FIELD_NUMBER: _ClassVar[int]
    PAGES_LAZY_FIELD_NUMBER: _ClassVar[int]
    freezing_time: int
    frozen_time: int
    memdump_time: int
    memwrite_time: int
    pages_scanned: int
    pages_skipped_parent: int
    pages_written: int
    irmap_resolve: int
    pages_lazy: int
    def __init__(self, freezing_time: _Optional[int] = ..., frozen_time: _Optional[int] = ..., memdump_time: _Optional[int] = ..., memwrite_time: _Optional[int] = ..., pages_scanned: _Optional[int] = ..., pages_skipped_parent: _Optional[int] = ..., pages_written: _Optional[int] = ..., irmap_resolve: _Optional[int] = ..., pages_lazy: _Optional[int] = ...) -> None: ...

class RestoreStatsEntry(_message.Message):
    __slots__ = ("pages_compared", "pages_skipped_cow", "forking_time", "restore_time", "pages_restored")
    PAGES_COMPARED_FIELD_NUMBER: _ClassVar[int]
    PAGES_SKIPPED_COW_FIELD_NUMBER: _ClassVar[int]
    FORKING_TIME_FIELD_NUMBER: _ClassVar[int]
    RESTORE_TIME_FIELD_NUMBER: _ClassVar[int]
    PAGES_RESTORED_FIELD_NUMBER: _ClassVar[int]
    pages_compared: int
    pages_skipped_cow: int
    forking_time: int
    restore_time: int
    pages_restored: int
    def __init__(self, pages_compared: _Optional[int] = ..., pages_skipped_cow: _Optional[int] = ..., forking_time: _Optional[int] = ..., restore_time: _Optional[int] = ..., pages_restored: _Optional[int] = ...) -> None: ...

class StatsEntry(_message.Message):
    __slots__ = ("dump", "restore")
    DUMP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    dump: DumpStatsEntry
    restore: RestoreStatsEntry
    def __init__(self, dump: _Optional[_Union[DumpStatsEntry, _Mapping]] = ..., restore: _Optional[_Union[RestoreStatsEntry, _Mapping]] = ...) -> None: ...
