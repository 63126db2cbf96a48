from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckpointState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_STATE_UNSPECIFIED: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_DUMPING: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_STAGED: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_DRAINING: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_DURABLE: _ClassVar[CheckpointState]
    CHECKPOINT_STATE_FAILED: _ClassVar[CheckpointState]

class WaitFor(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WAIT_FOR_UNSPECIFIED: _ClassVar[WaitFor]
    WAIT_FOR_STAGED: _ClassVar[WaitFor]
    WAIT_FOR_DURABLE: _ClassVar[WaitFor]
CHECKPOINT_STATE_UNSPECIFIED: CheckpointState
CHECKPOINT_STATE_DUMPING: CheckpointState
CHECKPOINT_STATE_STAGED: CheckpointState
CHECKPOINT_STATE_DRAINING: CheckpointState
CHECKPOINT_STATE_DURABLE: CheckpointState
CHECKPOINT_STATE_FAILED: CheckpointState
WAIT_FOR_UNSPECIFIED: WaitFor
WAIT_FOR_STAGED: WaitFor
WAIT_FOR_DURABLE: WaitFor

class StatusRequest(_message.Message):
    __slots__ = ("op_id",)
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    def __init__(self, op_id: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "criu_version", "hostname", "tier_dir", "tier_used_bytes", "tier_free_bytes", "tier_capacity_bytes", "store", "jobs_running", "checkpoints", "checkpoints_by_state", "drain_queue_depth", "drain_queue_bytes", "kernel", "moves_in_doubt", "guard", "store_id", "progress", "drains_paused", "drains_paused_since_unix_ms", "drains_paused_reason", "drains_held", "drain_pauses", "drain_waits", "drain_pause_overrides", "drains_paused_seconds", "tier_fs", "usage", "net_ns", "store_bad_objects", "store_bad_object_count", "image_port")
    class CheckpointsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CRIU_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    TIER_DIR_FIELD_NUMBER: _ClassVar[int]
    TIER_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    JOBS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    DRAIN_QUEUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    MOVES_IN_DOUBT_FIELD_NUMBER: _ClassVar[int]
    GUARD_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DRAINS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    DRAINS_PAUSED_SINCE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DRAINS_PAUSED_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAINS_HELD_FIELD_NUMBER: _ClassVar[int]
    DRAIN_PAUSES_FIELD_NUMBER: _ClassVar[int]
    DRAIN_WAITS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_PAUSE_OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    DRAINS_PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NET_NS_FIELD_NUMBER: _ClassVar[int]
    STORE_BAD_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    STORE_BAD_OBJECT_COUNT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PORT_FIELD_NUMBER: _ClassVar[int]
    version: str
    criu_version: str
    hostname: str
    tier_dir: str
    tier_used_bytes: int
    tier_free_bytes: int
    tier_capacity_bytes: int
    store: str
    jobs_running: int
    checkpoints: int
    checkpoints_by_state: _containers.ScalarMap[str, int]
    drain_queue_depth: int
    drain_queue_bytes: int
    kernel: str
    moves_in_doubt: _containers.RepeatedScalarFieldContainer[str]
    guard: str
    store_id: str
    progress: Progress
    drains_paused: bool
    drains_paused_since_unix_ms: int
    drains_paused_reason: str
    drains_held: _containers.RepeatedScalarFieldContainer[str]
    drain_pauses: int
    drain_waits: int
    drain_pause_overrides: int
    drains_paused_seconds: float
    tier_fs: str
    usage: _containers.RepeatedCompositeFieldContainer[QuotaUsage]
    net_ns: str
    store_bad_objects: _containers.RepeatedScalarFieldContainer[str]
    store_bad_object_count: int
    image_port: int
    def __init__(self, version: _Optional[str] = ..., criu_version: _Optional[str] = ..., hostname: _Optional[str] = ..., tier_dir: _Optional[str] = ..., tier_used_bytes: _Optional[int] = ..., tier_free_bytes: _Optional[int] = ..., tier_capacity_bytes: _Optional[int] = ..., store: _Optional[str] = ..., jobs_running: _Optional[int] = ..., checkpoints: _Optional[int] = ..., checkpoints_by_state: _Optional[_Mapping[str, int]] = ..., drain_queue_depth: _Optional[int] = ..., drain_queue_bytes: _Optional[int] = ..., kernel: _Optional[str] = ..., moves_in_doubt: _Optional[_Iterable[str]] = ..., guard: _Optional[str] = ..., store_id: _Optional[str] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., drains_paused: _Optional[bool] = ..., drains_paused_since_unix_ms: _Optional[int] = ..., drains_paused_reason: _Optional[str] = ..., drains_held: _Optional[_Iterable[str]] = ..., drain_pauses: _Optional[int] = ..., drain_waits: _Optional[int] = ..., drain_pause_overrides: _Optional[int] = ..., drains_paused_seconds: _Optional[float] = ..., tier_fs: _Optional[str] = ..., usage: _Optional[_Iterable[_Union[QuotaUsage, _Mapping]]] = ..., net_ns: _Optional[str] = ..., store_bad_objects: _Optional[_Iterable[str]] = ..., store_bad_object_count: _Optional[int] = ..., image_port: _Optional[int] = ...) -> None: ...

class QuotaUsage(_message.Message):
    __slots__ = ("uid", "tier_bytes", "store_bytes", "jobs", "checkpoints", "tier_bytes_limit", "store_bytes_limit", "jobs_limit", "checkpoints_limit")
    UID_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    JOBS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    uid: int
    tier_bytes: int
    store_bytes: int
    jobs: int
    checkpoints: int
    tier_bytes_limit: int
    store_bytes_limit: int
    jobs_limit: int
    checkpoints_limit: int
    def __init__(self, uid: _Optional[int] = ..., tier_bytes: _Optional[int] = ..., store_bytes: _Optional[int] = ..., jobs: _Optional[int] = ..., checkpoints: _Optional[int] = ..., tier_bytes_limit: _Optional[int] = ..., store_bytes_limit: _Optional[int] = ..., jobs_limit: _Optional[int] = ..., checkpoints_limit: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("op_id", "kind", "phase", "done_bytes", "total_bytes", "started_unix_ms")
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    op_id: str
    kind: str
    phase: str
    done_bytes: int
    total_bytes: int
    started_unix_ms: int
    def __init__(self, op_id: _Optional[str] = ..., kind: _Optional[str] = ..., phase: _Optional[str] = ..., done_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., started_unix_ms: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "name", "pid", "argv", "owner_uid", "log_path", "started_unix_ms", "running", "restored_from", "guard_state", "parked_reason", "parked_unix_ms", "parked_checkpoint", "memory_limit_bytes", "priority", "resumed_as", "moved_from")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FROM_FIELD_NUMBER: _ClassVar[int]
    GUARD_STATE_FIELD_NUMBER: _ClassVar[int]
    PARKED_REASON_FIELD_NUMBER: _ClassVar[int]
    PARKED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PARKED_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FROM_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    pid: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    owner_uid: int
    log_path: str
    started_unix_ms: int
    running: bool
    restored_from: str
    guard_state: str
    parked_reason: str
    parked_unix_ms: int
    parked_checkpoint: str
    memory_limit_bytes: int
    priority: int
    resumed_as: str
    moved_from: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., pid: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., owner_uid: _Optional[int] = ..., log_path: _Optional[str] = ..., started_unix_ms: _Optional[int] = ..., running: _Optional[bool] = ..., restored_from: _Optional[str] = ..., guard_state: _Optional[str] = ..., parked_reason: _Optional[str] = ..., parked_unix_ms: _Optional[int] = ..., parked_checkpoint: _Optional[str] = ..., memory_limit_bytes: _Optional[int] = ..., priority: _Optional[int] = ..., resumed_as: _Optional[str] = ..., moved_from: _Optional[str] = ...) -> None: ...

class RunJobRequest(_message.Message):
    __slots__ = ("argv", "name", "cwd", "env", "own_proc", "private_tmp", "memory_limit_bytes", "priority", "critical", "on_limit", "keep_last", "keep_within_s")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARGV_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    OWN_PROC_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_TMP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_FIELD_NUMBER: _ClassVar[int]
    ON_LIMIT_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    KEEP_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    argv: _containers.RepeatedScalarFieldContainer[str]
    name: str
    cwd: str
    env: _containers.ScalarMap[str, str]
    own_proc: bool
    private_tmp: bool
    memory_limit_bytes: int
    priority: int
    critical: bool
    on_limit: str
    keep_last: int
    keep_within_s: float
    def __init__(self, argv: _Optional[_Iterable[str]] = ..., name: _Optional[str] = ..., cwd: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., own_proc: _Optional[bool] = ..., private_tmp: _Optional[bool] = ..., memory_limit_bytes: _Optional[int] = ..., priority: _Optional[int] = ..., critical: _Optional[bool] = ..., on_limit: _Optional[str] = ..., keep_last: _Optional[int] = ..., keep_within_s: _Optional[float] = ...) -> None: ...

class RunJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("model", "uuid", "driver_version", "device_bytes", "pid")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    model: str
    uuid: str
    driver_version: str
    device_bytes: int
    pid: int
    def __init__(self, model: _Optional[str] = ..., uuid: _Optional[str] = ..., driver_version: _Optional[str] = ..., device_bytes: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("id", "state", "pid", "job", "name", "owner_uid", "created_unix_ms", "size_bytes", "frozen_ms", "dump_ms", "in_tier", "in_store", "drained_bytes", "stored_bytes", "last_error", "drain_attempts", "argv", "hostname", "criu_version", "gpus", "durable_unix_ms", "parked_reason", "parked_unix_ms", "logical_bytes", "new_bytes", "host_bytes", "device_bytes", "phases", "restore_phases", "container")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_UID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FROZEN_MS_FIELD_NUMBER: _ClassVar[int]
    DUMP_MS_FIELD_NUMBER: _ClassVar[int]
    IN_TIER_FIELD_NUMBER: _ClassVar[int]
    IN_STORE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DRAIN_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CRIU_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PARKED_REASON_FIELD_NUMBER: _ClassVar[int]
    PARKED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEW_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PHASES_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: CheckpointState
    pid: int
    job: str
    name: str
    owner_uid: int
    created_unix_ms: int
    size_bytes: int
    frozen_ms: int
    dump_ms: int
    in_tier: bool
    in_store: bool
    drained_bytes: int
    stored_bytes: int
    last_error: str
    drain_attempts: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    hostname: str
    criu_version: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    durable_unix_ms: int
    parked_reason: str
    parked_unix_ms: int
    logical_bytes: int
    new_bytes: int
    host_bytes: int
    device_bytes: int
    phases: _containers.RepeatedCompositeFieldContainer[Phase]
    restore_phases: _containers.RepeatedCompositeFieldContainer[Phase]
    container: str
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[CheckpointState, str]] = ..., pid: _Optional[int] = ..., job: _Optional[str] = ..., name: _Optional[str] = ..., owner_uid: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., size_bytes: _Optional[int] = ..., frozen_ms: _Optional[int] = ..., dump_ms: _Optional[int] = ..., in_tier: _Optional[bool] = ..., in_store: _Optional[bool] = ..., drained_bytes: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., last_error: _Optional[str] = ..., drain_attempts: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., hostname: _Optional[str] = ..., criu_version: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., durable_unix_ms: _Optional[int] = ..., parked_reason: _Optional[str] = ..., parked_unix_ms: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., new_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., device_bytes: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[Phase, _Mapping]]] = ..., restore_phases: _Optional[_Iterable[_Union[Phase, _Mapping]]] = ..., container: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("target", "stop", "wait", "tcp_established", "name", "keep_last", "keep_within_s", "fail_on_in_flight")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TCP_ESTABLISHED_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    KEEP_WITHIN_S_FIELD_NUMBER: _ClassVar[int]
    FAIL_ON_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    target: str
    stop: bool
    wait: WaitFor
    tcp_established: bool
    name: str
    keep_last: int
    keep_within_s: float
    fail_on_in_flight: bool
    def __init__(self, target: _Optional[str] = ..., stop: _Optional[bool] = ..., wait: _Optional[_Union[WaitFor, str]] = ..., tcp_established: _Optional[bool] = ..., name: _Optional[str] = ..., keep_last: _Optional[int] = ..., keep_within_s: _Optional[float] = ..., fail_on_in_flight: _Optional[bool] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointInfo
    def __init__(self, checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("checkpoint_id", "lazy", "gpu_map", "tcp_established", "op_id", "into")
    class GpuMapEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LAZY_FIELD_NUMBER: _ClassVar[int]
    GPU_MAP_FIELD_NUMBER: _ClassVar[int]
    TCP_ESTABLISHED_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    lazy: bool
    gpu_map: _containers.ScalarMap[str, str]
    tcp_established: bool
    op_id: str
    into: str
    def __init__(self, checkpoint_id: _Optional[str] = ..., lazy: _Optional[bool] = ..., gpu_map: _Optional[_Mapping[str, str]] = ..., tcp_established: _Optional[bool] = ..., op_id: _Optional[str] = ..., into: _Optional[str] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("pid", "job", "restore_ms", "verify_ms", "fetch_ms", "from_store", "paged_in_ms", "phases")
    PID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    RESTORE_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    FETCH_MS_FIELD_NUMBER: _ClassVar[int]
    FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    PAGED_IN_MS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    job: Job
    restore_ms: int
    verify_ms: int
    fetch_ms: int
    from_store: bool
    paged_in_ms: int
    phases: _containers.RepeatedCompositeFieldContainer[Phase]
    def __init__(self, pid: _Optional[int] = ..., job: _Optional[_Union[Job, _Mapping]] = ..., restore_ms: _Optional[int] = ..., verify_ms: _Optional[int] = ..., fetch_ms: _Optional[int] = ..., from_store: _Optional[bool] = ..., paged_in_ms: _Optional[int] = ..., phases: _Optional[_Iterable[_Union[Phase, _Mapping]]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GetCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointInfo
    def __init__(self, checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteCheckpointResponse(_message.Message):
    __slots__ = ("note",)
    NOTE_FIELD_NUMBER: _ClassVar[int]
    note: str
    def __init__(self, note: _Optional[str] = ...) -> None: ...

class EvictCheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class EvictCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: CheckpointInfo
    def __init__(self, checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ...) -> None: ...

class WatchCheckpointRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("target", "to", "via_store", "lazy", "move_ip", "tcp_established", "move_ip_dev_source", "move_ip_dev_target", "to_token", "plain_restore", "op_id", "fail_on_in_flight", "into")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    VIA_STORE_FIELD_NUMBER: _ClassVar[int]
    LAZY_FIELD_NUMBER: _ClassVar[int]
    MOVE_IP_FIELD_NUMBER: _ClassVar[int]
    TCP_ESTABLISHED_FIELD_NUMBER: _ClassVar[int]
    MOVE_IP_DEV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    MOVE_IP_DEV_TARGET_FIELD_NUMBER: _ClassVar[int]
    TO_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PLAIN_RESTORE_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    FAIL_ON_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    target: str
    to: str
    via_store: bool
    lazy: bool
    move_ip: str
    tcp_established: bool
    move_ip_dev_source: str
    move_ip_dev_target: str
    to_token: str
    plain_restore: bool
    op_id: str
    fail_on_in_flight: bool
    into: str
    def __init__(self, target: _Optional[str] = ..., to: _Optional[str] = ..., via_store: _Optional[bool] = ..., lazy: _Optional[bool] = ..., move_ip: _Optional[str] = ..., tcp_established: _Optional[bool] = ..., move_ip_dev_source: _Optional[str] = ..., move_ip_dev_target: _Optional[str] = ..., to_token: _Optional[str] = ..., plain_restore: _Optional[bool] = ..., op_id: _Optional[str] = ..., fail_on_in_flight: _Optional[bool] = ..., into: _Optional[str] = ...) -> None: ...

class Phase(_message.Message):
    __slots__ = ("name", "ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ms: int
    def __init__(self, name: _Optional[str] = ..., ms: _Optional[int] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("target_pid", "checkpoint_id", "phases", "downtime_ms", "bytes_sent", "target_job", "note")
    TARGET_PID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    DOWNTIME_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_JOB_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    target_pid: int
    checkpoint_id: str
    phases: _containers.RepeatedCompositeFieldContainer[Phase]
    downtime_ms: int
    bytes_sent: int
    target_job: str
    note: str
    def __init__(self, target_pid: _Optional[int] = ..., checkpoint_id: _Optional[str] = ..., phases: _Optional[_Iterable[_Union[Phase, _Mapping]]] = ..., downtime_ms: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., target_job: _Optional[str] = ..., note: _Optional[str] = ...) -> None: ...

class ImageChunk(_message.Message):
    __slots__ = ("checkpoint_id", "file", "offset", "data", "blake3", "file_done", "manifest", "expected_bytes", "channel_ticket")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLAKE3_FIELD_NUMBER: _ClassVar[int]
    FILE_DONE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_TICKET_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    file: str
    offset: int
    data: bytes
    blake3: bytes
    file_done: bool
    manifest: bytes
    expected_bytes: int
    channel_ticket: bytes
    def __init__(self, checkpoint_id: _Optional[str] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., blake3: _Optional[bytes] = ..., file_done: _Optional[bool] = ..., manifest: _Optional[bytes] = ..., expected_bytes: _Optional[int] = ..., channel_ticket: _Optional[bytes] = ...) -> None: ...

class ReceiveImageResponse(_message.Message):
    __slots__ = ("checkpoint_id", "bytes")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    bytes: int
    def __init__(self, checkpoint_id: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class TunnelChunk(_message.Message):
    __slots__ = ("tunnel_id", "data", "done", "ok", "error", "tag")
    TUNNEL_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    tunnel_id: str
    data: bytes
    done: bool
    ok: bool
    error: str
    tag: bytes
    def __init__(self, tunnel_id: _Optional[str] = ..., data: _Optional[bytes] = ..., done: _Optional[bool] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., tag: _Optional[bytes] = ...) -> None: ...

class RestoreReceivedRequest(_message.Message):
    __slots__ = ("checkpoint_id", "lazy", "lazy_tunnel", "add_ip", "add_ip_dev", "tcp_established", "from_store", "early_resume", "into")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LAZY_FIELD_NUMBER: _ClassVar[int]
    LAZY_TUNNEL_FIELD_NUMBER: _ClassVar[int]
    ADD_IP_FIELD_NUMBER: _ClassVar[int]
    ADD_IP_DEV_FIELD_NUMBER: _ClassVar[int]
    TCP_ESTABLISHED_FIELD_NUMBER: _ClassVar[int]
    FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    EARLY_RESUME_FIELD_NUMBER: _ClassVar[int]
    INTO_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    lazy: bool
    lazy_tunnel: str
    add_ip: str
    add_ip_dev: str
    tcp_established: bool
    from_store: CheckpointInfo
    early_resume: bool
    into: str
    def __init__(self, checkpoint_id: _Optional[str] = ..., lazy: _Optional[bool] = ..., lazy_tunnel: _Optional[str] = ..., add_ip: _Optional[str] = ..., add_ip_dev: _Optional[str] = ..., tcp_established: _Optional[bool] = ..., from_store: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., early_resume: _Optional[bool] = ..., into: _Optional[str] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("job", "timeout_s", "kill")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    KILL_FIELD_NUMBER: _ClassVar[int]
    job: str
    timeout_s: float
    kill: bool
    def __init__(self, job: _Optional[str] = ..., timeout_s: _Optional[float] = ..., kill: _Optional[bool] = ...) -> None: ...

class StopJobResponse(_message.Message):
    __slots__ = ("job", "killed", "stop_ms")
    JOB_FIELD_NUMBER: _ClassVar[int]
    KILLED_FIELD_NUMBER: _ClassVar[int]
    STOP_MS_FIELD_NUMBER: _ClassVar[int]
    job: Job
    killed: bool
    stop_ms: int
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., killed: _Optional[bool] = ..., stop_ms: _Optional[int] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job", "force")
    JOB_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    job: str
    force: bool
    def __init__(self, job: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteJobResponse(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: Job
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ...) -> None: ...

class PruneRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class PruneResponse(_message.Message):
    __slots__ = ("jobs", "checkpoints", "log_bytes")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    LOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    log_bytes: int
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ..., log_bytes: _Optional[int] = ...) -> None: ...

class JobLogsRequest(_message.Message):
    __slots__ = ("job", "follow", "tail_bytes")
    JOB_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    job: str
    follow: bool
    tail_bytes: int
    def __init__(self, job: _Optional[str] = ..., follow: _Optional[bool] = ..., tail_bytes: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("data", "job", "path")
    DATA_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    job: str
    path: str
    def __init__(self, data: _Optional[bytes] = ..., job: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ResumeJobRequest(_message.Message):
    __slots__ = ("job", "memory_limit_bytes", "op_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    memory_limit_bytes: int
    op_id: str
    def __init__(self, job: _Optional[str] = ..., memory_limit_bytes: _Optional[int] = ..., op_id: _Optional[str] = ...) -> None: ...

class GcRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class GcKept(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: str
    reason: str
    def __init__(self, id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GcResponse(_message.Message):
    __slots__ = ("dry_run", "deleted", "kept", "checkpoint_bytes", "swept", "sweep_note", "chunks_swept", "chunk_bytes_freed", "chunks_in_grace", "duration_ms", "forgotten")
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWEPT_FIELD_NUMBER: _ClassVar[int]
    SWEEP_NOTE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SWEPT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_IN_GRACE_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    deleted: _containers.RepeatedCompositeFieldContainer[CheckpointInfo]
    kept: _containers.RepeatedCompositeFieldContainer[GcKept]
    checkpoint_bytes: int
    swept: bool
    sweep_note: str
    chunks_swept: int
    chunk_bytes_freed: int
    chunks_in_grace: int
    duration_ms: int
    forgotten: _containers.RepeatedCompositeFieldContainer[GcKept]
    def __init__(self, dry_run: _Optional[bool] = ..., deleted: _Optional[_Iterable[_Union[CheckpointInfo, _Mapping]]] = ..., kept: _Optional[_Iterable[_Union[GcKept, _Mapping]]] = ..., checkpoint_bytes: _Optional[int] = ..., swept: _Optional[bool] = ..., sweep_note: _Optional[str] = ..., chunks_swept: _Optional[int] = ..., chunk_bytes_freed: _Optional[int] = ..., chunks_in_grace: _Optional[int] = ..., duration_ms: _Optional[int] = ..., forgotten: _Optional[_Iterable[_Union[GcKept, _Mapping]]] = ...) -> None: ...
