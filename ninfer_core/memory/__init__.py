"""Memory planning: weights, the paged KV pool, activation workspace and headroom.

`plan_memory` decides the KV pool's size before anything is allocated and fails early,
with the numbers, when a configuration cannot fit; `table` prints the plan. See
`docs/memory.md`.
"""

from ninfer_core.memory.planner import (
    AutoCapacityTooSmallError,
    CapacityBelowContextError,
    CapacityDoesNotFitError,
    DeviceMemory,
    LayerKV,
    MemoryConfig,
    MemoryPlan,
    MemoryPlanError,
    cpu_runtime_bytes,
    device_memory,
    kv_layers,
    parse_kv_capacity,
    plan_memory,
    weights_bytes,
)
from ninfer_core.memory.workspace import Workspace, estimate_workspace, measure_workspace

__all__ = [
    "AutoCapacityTooSmallError",
    "CapacityBelowContextError",
    "CapacityDoesNotFitError",
    "DeviceMemory",
    "LayerKV",
    "MemoryConfig",
    "MemoryPlan",
    "MemoryPlanError",
    "Workspace",
    "cpu_runtime_bytes",
    "device_memory",
    "estimate_workspace",
    "kv_layers",
    "measure_workspace",
    "parse_kv_capacity",
    "plan_memory",
    "weights_bytes",
]
