from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CgroupMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IGNORE: _ClassVar[CgroupMode]
    CG_NONE: _ClassVar[CgroupMode]
    PROPS: _ClassVar[CgroupMode]
    SOFT: _ClassVar[CgroupMode]
    FULL: _ClassVar[CgroupMode]
    STRICT: _ClassVar[CgroupMode]
    DEFAULT: _ClassVar[CgroupMode]

class NetworkLockMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NETWORK_LOCK_UNSET: _ClassVar[NetworkLockMethod]
    IPTABLES: _ClassVar[NetworkLockMethod]
    NFTABLES: _ClassVar[NetworkLockMethod]
    SKIP: _ClassVar[NetworkLockMethod]

class ReqType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EMPTY: _ClassVar[ReqType]
    DUMP: _ClassVar[ReqType]
    RESTORE: _ClassVar[ReqType]
    CHECK: _ClassVar[ReqType]
    PRE_DUMP: _ClassVar[ReqType]
    PAGE_SERVER: _ClassVar[ReqType]
    NOTIFY: _ClassVar[ReqType]
    CPUINFO_DUMP: _ClassVar[ReqType]
    CPUINFO_CHECK: _ClassVar[ReqType]
    FEATURE_CHECK: _ClassVar[ReqType]
    VERSION: _ClassVar[ReqType]
    WAIT_PID: _ClassVar[ReqType]
    PAGE_SERVER_CHLD: _ClassVar[ReqType]
    SINGLE_PRE_DUMP: _ClassVar[ReqType]
IGNORE: CgroupMode
CG_NONE: CgroupMode
PROPS: CgroupMode
SOFT: CgroupMode
FULL: CgroupMode
STRICT: CgroupMode
DEFAULT: CgroupMode
NETWORK_LOCK_UNSET: NetworkLockMethod
IPTABLES: NetworkLockMethod
NFTABLES: NetworkLockMethod
SKIP: NetworkLockMethod
EMPTY: ReqType
DUMP: ReqType
RESTORE: ReqType
CHECK: ReqType
PRE_DUMP: ReqType
PAGE_SERVER: ReqType
NOTIFY: ReqType
CPUINFO_DUMP: ReqType
CPUINFO_CHECK: ReqType
FEATURE_CHECK: ReqType
VERSION: ReqType
WAIT_PID: ReqType
PAGE_SERVER_CHLD: ReqType
SINGLE_PRE_DUMP: ReqType

class PageServerInfo(_message.Message):
    __slots__ = ("address", "port", "pid", "fd")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    pid: int
    fd: int
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ...) -> None: ...

class InheritFd(_message.Message):
    __slots__ = ("key", "fd")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    key: str
    fd: int
    def __init__(self, key: _Optional[str] = ..., fd: _Optional[int] = ...) -> None: ...

class JoinNamespace(_message.Message):
    __slots__ = ("ns", "ns_file", "extra_opt")
    NS_FIELD_NUMBER: _ClassVar[int]
    NS_FILE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_OPT_FIELD_NUMBER: _ClassVar[int]
    ns: str
    ns_file: str
    extra_opt: str
    def __init__(self, ns: _Optional[str] = ..., ns_file: _Optional[str] = ..., extra_opt: _Optional[str] = ...) -> None: ...

class Opts(_message.Message):
    __slots__ = ("images_dir_fd", "pid", "leave_running", "ext_unix_sk", "tcp_established", "shell_job", "file_locks", "log_level", "log_file", "ps", "notify_scripts", "root", "parent_img", "work_dir_fd", "link_remap", "manage_cgroups", "rst_sibling", "inherit_fd", "auto_ext_mnt", "ext_sharing", "ext_masters", "skip_mnt", "manage_cgroups_mode", "external", "join_ns", "timeout", "tcp_skip_in_flight", "lazy_pages", "config_file", "tcp_close", "network_lock", "leave_stopped")
    IMAGES_DIR_FD_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    LEAVE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    EXT_UNIX_SK_FIELD_NUMBER: _ClassVar[int]
    TCP_ESTABLISHED_FIELD_NUMBER: _ClassVar[int]
    SHELL_JOB_FIELD_NUMBER: _ClassVar[int]
    FILE_LOCKS_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    LOG_FILE_FIELD_NUMBER: _ClassVar[int]
    PS_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_SCRIPTS_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PARENT_IMG_FIELD_NUMBER: _ClassVar[int]
    WORK_DIR_FD_FIELD_NUMBER: _ClassVar[int]
    LINK_REMAP_FIELD_NUMBER: _ClassVar[int]
    MANAGE_CGROUPS_FIELD_NUMBER: _ClassVar[int]
    RST_SIBLING_FIELD_NUMBER: _ClassVar[int]
    INHERIT_FD_FIELD_NUMBER: _ClassVar[int]
    AUTO_EXT_MNT_FIELD_NUMBER: _ClassVar[int]
    EXT_SHARING_FIELD_NUMBER: _ClassVar[int]
    EXT_MASTERS_FIELD_NUMBER: _ClassVar[int]
    SKIP_MNT_FIELD_NUMBER: _ClassVar[int]
    MANAGE_CGROUPS_MODE_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    JOIN_NS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    TCP_SKIP_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LAZY_PAGES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FILE_FIELD_NUMBER: _ClassVar[int]
    TCP_CLOSE_FIELD_NUMBER: _ClassVar[int]
    NETWORK_LOCK_FIELD_NUMBER: _ClassVar[int]
    LEAVE_STOPPED_FIELD_NUMBER: _ClassVar[int]
    images_dir_fd: int
    pid: int
    leave_running: bool
    ext_unix_sk: bool
    tcp_established: bool
    shell_job: bool
    file_locks: bool
    log_level: int
    log_file: str
    ps: PageServerInfo
    notify_scripts: bool
    root: str
    parent_img: str
    work_dir_fd: int
    link_remap: bool
    manage_cgroups: bool
    rst_sibling: bool
    inherit_fd: _containers.RepeatedCompositeFieldContainer[InheritFd]
    auto_ext_mnt: bool
    ext_sharing: bool
    ext_masters: bool
    skip_mnt: _containers.RepeatedScalarFieldContainer[str]
    manage_cgroups_mode: CgroupMode
    external: _containers.RepeatedScalarFieldContainer[str]
    join_ns: _containers.RepeatedCompositeFieldContainer[JoinNamespace]
    timeout: int
    tcp_skip_in_flight: bool
    lazy_pages: bool
    config_file: str
    tcp_close: bool
    network_lock: NetworkLockMethod
    leave_stopped: bool
    def __init__(self, images_dir_fd: _Optional[int] = ..., pid: _Optional[int] = ..., leave_running: _Optional[bool] = ..., ext_unix_sk: _Optional[bool] = ..., tcp_established: _Optional[bool] = ..., shell_job: _Optional[bool] = ..., file_locks: _Optional[bool] = ..., log_level: _Optional[int] = ..., log_file: _Optional[str] = ..., ps: _Optional[_Union[PageServerInfo, _Mapping]] = ..., notify_scripts: _Optional[bool] = ..., root: _Optional[str] = ..., parent_img: _Optional[str] = ..., work_dir_fd: _Optional[int] = ..., link_remap: _Optional[bool] = ..., manage_cgroups: _Optional[bool] = ..., rst_sibling: _Optional[bool] = ..., inherit_fd: _Optional[_Iterable[_Union[InheritFd, _Mapping]]] = ..., auto_ext_mnt: _Optional[bool] = ..., ext_sharing: _Optional[bool] = ..., ext_masters: _Optional[bool] = ..., skip_mnt: _Optional[_Iterable[str]] = ..., manage_cgroups_mode: _Optional[_Union[CgroupMode, str]] = ..., external: _Optional[_Iterable[str]] = ..., join_ns: _Optional[_Iterable[_Union[JoinNamespace, _Mapping]]] = ..., timeout: _Optional[int] = ..., tcp_skip_in_flight: _Optional[bool] = ..., lazy_pages: _Optional[bool] = ..., config_file: _Optional[str] = ..., tcp_close: _Optional[bool] = ..., network_lock: _Optional[_Union[NetworkLockMethod, str]] = ..., leave_stopped: _Optional[bool] = ...) -> None: ...

class DumpResp(_message.Message):
    __slots__ = ("restored",)
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    restored: bool
    def __init__(self, restored: _Optional[bool] = ...) -> None: ...

class RestoreResp(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class Notify(_message.Message):
    __slots__ = ("script", "pid")
    SCRIPT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    script: str
    pid: int
    def __init__(self, script: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("mem_track", "lazy_pages", "pidfd_store")
    MEM_TRACK_FIELD_NUMBER: _ClassVar[int]
    LAZY_PAGES_FIELD_NUMBER: _ClassVar[int]
    PIDFD_STORE_FIELD_NUMBER: _ClassVar[int]
    mem_track: bool
    lazy_pages: bool
    pidfd_store: bool
    def __init__(self, mem_track: _Optional[bool] = ..., lazy_pages: _Optional[bool] = ..., pidfd_store: _Optional[bool] = ...) -> None: ...

class Req(_message.Message):
    __slots__ = ("type", "opts", "notify_success", "keep_open", "features", "pid")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    OPTS_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_SUCCESS_FIELD_NUMBER: _ClassVar[int]
    KEEP_OPEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    type: ReqType
    opts: Opts
    notify_success: bool
    keep_open: bool
    features: Features
    pid: int
    def __init__(self, type: _Optional[_Union[ReqType, str]] = ..., opts: _Optional[_Union[Opts, _Mapping]] = ..., notify_success: _Optional[bool] = ..., keep_open: _Optional[bool] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., pid: _Optional[int] = ...) -> None: ...

class Version(_message.Message):
    __slots__ = ("major_number", "minor_number", "gitid", "sublevel", "extra", "name")
    MAJOR_NUMBER_FIELD_NUMBER: _ClassVar[int]
    MINOR_NUMBER_FIELD_NUMBER: _ClassVar[int]
    GITID_FIELD_NUMBER: _ClassVar[int]
    SUBLEVEL_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    major_number: int
    minor_number: int
    gitid: str
    sublevel: int
    extra: int
    name: str
    def __init__(self, major_number: _Optional[int] = ..., minor_number: _Optional[int] = ..., gitid: _Optional[str] = ..., sublevel: _Optional[int] = ..., extra: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class Resp(_message.Message):
    __slots__ = ("type", "success", "dump", "restore", "notify", "ps", "cr_errno", "features", "cr_errmsg", "version", "status")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    DUMP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_FIELD_NUMBER: _ClassVar[int]
    PS_FIELD_NUMBER: _ClassVar[int]
    CR_ERRNO_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CR_ERRMSG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    type: ReqType
    success: bool
    dump: DumpResp
    restore: RestoreResp
    notify: Notify
    ps: PageServerInfo
    cr_errno: int
    features: Features
    cr_errmsg: str
    version: Version
    status: int
    def __init__(self, type: _Optional[_Union[ReqType, str]] = ..., success: _Optional[bool] = ..., dump: _Optional[_Union[DumpResp, _Mapping]] = ..., restore: _Optional[_Union[RestoreResp, _Mapping]] = ..., notify: _Optional[_Union[Notify, _Mapping]] = ..., ps: _Optional[_Union[PageServerInfo, _Mapping]] = ..., cr_errno: _Optional[int] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., cr_errmsg: _Optional[str] = ..., version: _Optional[_Union[Version, _Mapping]] = ..., status: _Optional[int] = ...) -> None: ...
