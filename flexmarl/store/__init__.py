"""Experience store: one table per agent."""

from flexmarl.store.experience import (
    ALLOWED_TRANSITIONS,
    AgentTable,
    ConsistencyError,
    ExperienceStore,
    LocalObjectStore,
    Row,
    Status,
    StoreError,
    TensorRef,
    check_row,
    make_sample_id,
    parse_sample_id,
)

__all__ = [
    "ALLOWED_TRANSITIONS",
    "AgentTable",
    "ConsistencyError",
    "ExperienceStore",
    "LocalObjectStore",
    "Row",
    "Status",
    "StoreError",
    "TensorRef",
    "check_row",
    "make_sample_id",
    "parse_sample_id",
]
