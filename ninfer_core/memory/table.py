"""A memory plan as people read it at startup (an aligned table) and as JSON for tools."""

from __future__ import annotations

import json
from typing import Any

from ninfer_core.memory.planner import GIB, MIB, MemoryPlan


def kv_summary(plan: MemoryPlan) -> str:
    """`rk8v4: 57600 bytes/token (36 layers x 1600)`, naming the layers that keep a
    per-sequence state instead."""
    keep = [layer for layer in plan.kv_layers if layer.kind == "paged"]
    sizes = sorted({layer.bytes_per_token for layer in keep})
    each = f" x {sizes[0]}" if len(sizes) == 1 else ""
    if len(keep) == len(plan.kv_layers):
        layers = f"{len(keep)} layers{each}"
    else:
        layers = f"{len(keep)} of {len(plan.kv_layers)} layers keep per-token KV{each}"
        stateful = len(plan.kv_layers) - len(keep)
        layers += f"; {stateful} keep {plan.state_bytes_per_sequence} bytes per sequence"
    return f"{plan.kv_codec}: {plan.kv_bytes_per_token} bytes/token ({layers})"


def rows(plan: MemoryPlan) -> list[tuple[str, int, str]]:
    """(what, bytes, detail) for each line of the table, the total last."""
    ws = plan.workspace
    capacity = plan.kv_capacity or "unset: --max-context"
    how = "measured" if ws.method == "measured" else "estimated"
    floor = f"{plan.headroom_fraction:.0%} of the free memory"
    if plan.headroom_bytes > int(plan.memory.free * plan.headroom_fraction):
        floor = f"the {plan.headroom_bytes / GIB:.2f} GiB floor (more than {floor})"
    chosen = f"--kv-capacity {capacity}"
    if plan.auto_reason:
        chosen += f"; {plan.auto_reason}"
    out = [
        ("weights", plan.weights_bytes, f"held as {plan.weights_dtype}"),
        (
            "KV pool",
            plan.pool_bytes,
            f"{plan.pool_tokens} tokens = {plan.pool_pages} pages x {plan.block_size} ({chosen})",
        ),
    ]
    out += draft_rows(plan)
    if plan.state_bytes:
        out.append((
            "sequence states",
            plan.state_bytes,
            f"{plan.max_concurrency} x {plan.state_bytes_per_sequence} bytes "
            "(--max-concurrency x the state layers' bytes, double-buffered)",
        ))  # fmt: skip
        if plan.draft is not None:  # engine/speculation.py: rollback by replay
            replay = "rejected drafts replay from the committed state: no more state"
            out.append(("draft rollback", 0, replay))
    if plan.snapshot_bytes:
        out.append((
            "state snapshots",
            plan.snapshot_bytes,
            f"{plan.state_snapshots} x {plan.snapshot_bytes_each} bytes (--state-snapshots x "
            "one state buffer and one page: the prefix cache of a model with state layers)",
        ))  # fmt: skip
    out += [
        (
            "activation workspace",
            ws.nbytes,
            f"{how}: {ws.prefill_chunk}-token step, {ws.concurrency} x {ws.context} context",
        ),
    ]
    if plan.runtime_bytes:
        out.append(("CPU runtime caches", plan.runtime_bytes, "compiled kernels, at most"))
    out.append(("reserved headroom", plan.headroom_bytes, floor))
    out.append(("free after startup", plan.free_after_bytes, "including the headroom"))
    out.append(("total", plan.memory.free, f"free memory from {plan.memory.source}"))
    return out


def _amount(n: int) -> str:
    """`0.7 MiB` below a GiB (the table's column rounds it to 0.00), else `1.50 GiB`."""
    return f"{n / MIB:.1f} MiB" if n < GIB else f"{n / GIB:.2f} GiB"


def draft_rows(plan: MemoryPlan) -> list[tuple[str, int, str]]:
    """The drafter's lines (`--spec`): its weights and tables, then its K/V over the pool's
    pages; one line for a drafter that holds nothing on the device."""
    draft = plan.draft
    if draft is None:
        return []
    name = f"--spec {plan.draft_strategy}"
    if not (draft.fixed_bytes or draft.kv_bytes_per_token):
        return [("drafter", 0, f"{name}: no weights, no per-token K/V")]
    held = f"{name}: own weights {_amount(draft.weights_bytes)}"
    if draft.table_bytes:
        held += f" + tables {_amount(draft.table_bytes)}"
    kv = f"{plan.pool_tokens} tokens x {draft.kv_bytes_per_token} bytes, in the KV pool's pages"
    if plan.draft_kv_bytes < GIB:
        kv += f" ({_amount(plan.draft_kv_bytes)})"
    return [("draft weights", plan.draft_bytes, held), ("draft K/V", plan.draft_kv_bytes, kv)]


def render_table(plan: MemoryPlan) -> str:
    """The plan as aligned lines: a header, then one row per use of memory, in GiB."""
    lines = [
        f"KV codec {kv_summary(plan)}",
        f"max context {plan.max_context} tokens, {plan.max_concurrency} sequences at once; "
        f"the largest KV pool that fits is {plan.largest_fit_tokens} tokens"
        + (" (with the drafter's K/V)" if plan.draft_kv_bytes_per_token else ""),
        "",
    ]
    table = rows(plan)
    width = max(len(name) for name, _, _ in table)
    for name, nbytes, detail in table:
        if name == "total":
            lines.append("-" * (width + 11))
        lines.append(f"{name:<{width}}  {nbytes / GIB:6.2f} GiB  {detail}")
    return "\n".join(lines)


def plan_json(plan: MemoryPlan, **extra: Any) -> dict[str, Any]:
    """`plan.to_json()` with `extra` keys (the model, the device) in front."""
    return {**extra, **plan.to_json()}


def render_json(plan: MemoryPlan, **extra: Any) -> str:
    return json.dumps(plan_json(plan, **extra), indent=2)
