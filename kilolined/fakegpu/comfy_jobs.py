"""ComfyUI's `/api/jobs` records, built from queue items and history entries (no I/O).

The shapes follow ComfyUI's own normalisation: a queued or running prompt is
`{id, status, priority, create_time, outputs_count: 0, previewable_outputs_count: 0}`, a finished
one adds its execution times, the error and a preview; `None` fields are left out.
"""

from __future__ import annotations

from typing import Any

PENDING, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "pending", "in_progress", "completed", "failed", "cancelled"
STATUSES = (PENDING, IN_PROGRESS, COMPLETED, FAILED, CANCELLED)
PREVIEWABLE = frozenset({"images", "video", "audio", "3d", "text"})


def _pruned(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if v is not None}


def _workflow_id(extra_data: dict[str, Any]) -> str | None:
    pnginfo = extra_data.get("extra_pnginfo")
    workflow = pnginfo.get("workflow") if isinstance(pnginfo, dict) else None
    found = workflow.get("id") if isinstance(workflow, dict) else None
    return found if isinstance(found, str) else None


def from_queue(item: list[Any], status: str) -> dict[str, Any]:
    """A pending or running prompt; `item` is its `/queue` entry."""
    number, prompt_id, _, extra_data, _ = item
    return _pruned({"id": prompt_id, "status": status, "priority": number,
                    "create_time": extra_data.get("create_time"), "outputs_count": 0,
                    "previewable_outputs_count": 0, "workflow_id": _workflow_id(extra_data)})


def _outputs_summary(outputs: dict[str, Any]) -> tuple[int, int, dict[str, Any] | None]:
    count = previewable = 0
    preview: dict[str, Any] | None = None
    fallback: dict[str, Any] | None = None
    for node_id, node_outputs in outputs.items():
        for media_type, items in node_outputs.items() if isinstance(node_outputs, dict) else ():
            for item in items if isinstance(items, list) else ():
                if not isinstance(item, dict):
                    continue
                count += 1
                if media_type not in PREVIEWABLE:
                    continue
                previewable += 1
                enriched = {**item, "nodeId": node_id, "mediaType": media_type}
                if item.get("type") == "output" and preview is None:
                    preview = enriched
                elif fallback is None:
                    fallback = enriched
    return count, previewable, preview or fallback


def from_history(prompt_id: str, entry: dict[str, Any], include_outputs: bool = False) -> dict[str, Any]:
    """A finished prompt; `entry` is its `/history` entry."""
    number, _, graph, extra_data, _ = entry["prompt"]
    status_info = entry.get("status") or {}
    started = ended = error = None
    interrupted = False
    for event, data in status_info.get("messages", []):
        if event == "execution_start":
            started = data.get("timestamp")
        elif event in ("execution_success", "execution_error", "execution_interrupted"):
            ended = data.get("timestamp")
            error = data if event == "execution_error" else error
            interrupted = interrupted or event == "execution_interrupted"
    status = (CANCELLED if interrupted else FAILED) if status_info.get("status_str") == "error" else COMPLETED
    count, previewable, preview = _outputs_summary(entry.get("outputs", {}))
    job = _pruned({"id": prompt_id, "status": status, "priority": number, "create_time": extra_data.get("create_time"),
                   "execution_start_time": started, "execution_end_time": ended, "execution_error": error,
                   "outputs_count": count, "previewable_outputs_count": previewable, "preview_output": preview,
                   "workflow_id": _workflow_id(extra_data)})
    if include_outputs:
        job["outputs"] = entry.get("outputs", {})
        job["execution_status"] = status_info
        job["workflow"] = {"prompt": graph, "extra_data": extra_data}
    return job


def page(jobs: list[dict[str, Any]], offset: int, limit: int | None) -> dict[str, Any]:
    """`GET /api/jobs`: one page of `jobs` (already filtered and sorted)."""
    chosen = jobs[offset:] if limit is None else jobs[offset:offset + limit]
    return {"jobs": chosen, "pagination": {"offset": offset, "limit": limit, "total": len(jobs),
                                           "has_more": offset + len(chosen) < len(jobs)}}
