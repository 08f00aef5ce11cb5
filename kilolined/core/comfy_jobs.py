"""ComfyUI's `/api/jobs` records, built from queue items and history entries (no I/O).

The shapes follow ComfyUI 0.19's own normalisation (tests/test_comfy_real_shapes.py runs its code
on the same records): a queued or running prompt is `{id, status, priority, create_time,
outputs_count: 0}`, a finished one adds its execution times, the error and a preview; `None`
fields are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PENDING, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "pending", "in_progress", "completed", "failed", "cancelled"
STATUSES = (PENDING, IN_PROGRESS, COMPLETED, FAILED, CANCELLED)
PREVIEWABLE = frozenset({"images", "video", "audio", "3d", "text"})
THREE_D = (".obj", ".fbx", ".gltf", ".glb", ".usdz")  # 3D files: previewable whatever their media type
TEXT_PREVIEW_MAX = 1024


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
                    "workflow_id": _workflow_id(extra_data)})


def _three_d(name: Any) -> bool:
    return isinstance(name, str) and name.lower().endswith(THREE_D)


def _previewable(media_type: str, item: dict[str, Any]) -> bool:
    fmt = item.get("format") or ""
    return media_type in PREVIEWABLE or (isinstance(fmt, str) and fmt.startswith(("video/", "audio/"))) \
        or _three_d(item.get("filename") or "")


def _as_file(item: Any) -> dict[str, Any] | None:
    """An output list item as a file dict: dicts as they are, a 3D file's bare name made one."""
    if isinstance(item, dict):
        return item
    if _three_d(item):
        return {"filename": item, "type": "output", "subfolder": "", "mediaType": "3d"}
    return None


def _outputs_summary(outputs: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
    """(how many outputs, the one the UI previews): the first previewable output of type
    ``output``, else the first previewable one (a text output's first words included)."""
    count = 0
    preview: dict[str, Any] | None = None
    fallback: dict[str, Any] | None = None
    for node_id, node_outputs in outputs.items():
        for media_type, items in node_outputs.items() if isinstance(node_outputs, dict) else ():
            if media_type == "animated" or not isinstance(items, list):
                continue
            for raw in items:
                item = _as_file(raw)
                if item is None:
                    if media_type == "text":  # a text output: counted, and a preview of last resort
                        count += 1
                        if preview is None and fallback is None:
                            text = (raw[0] if raw else "") if isinstance(raw, tuple) else str(raw)
                            cut = {"content": text[:TEXT_PREVIEW_MAX]}
                            if len(text) > TEXT_PREVIEW_MAX:
                                cut["truncated"] = True
                            fallback = {**cut, "nodeId": node_id, "mediaType": media_type}
                    continue
                count += 1
                if preview is not None or not _previewable(media_type, item):
                    continue
                enriched = {**item, "nodeId": node_id}
                enriched.setdefault("mediaType", media_type)
                if item.get("type") == "output":
                    preview = enriched
                elif fallback is None:
                    fallback = enriched
    return count, preview or fallback


def _outputs(outputs: dict[str, Any]) -> dict[str, Any]:
    """A job's ``outputs``: None items left out, a 3D file's bare name made a file dict."""
    out: dict[str, Any] = {}
    for node_id, node_outputs in outputs.items():
        if not isinstance(node_outputs, dict):
            out[node_id] = node_outputs
            continue
        out[node_id] = {media: items if media == "animated" or not isinstance(items, list)
                        else [_as_file(i) or i for i in items if i is not None]
                        for media, items in node_outputs.items()}
    return out


def from_history(prompt_id: str, entry: dict[str, Any], include_outputs: bool = False) -> dict[str, Any]:
    """A finished prompt; `entry` is its `/history` entry."""
    number, _, graph, extra_data, _ = entry["prompt"]
    status_info = entry.get("status") or {}
    started = ended = error = None
    interrupted = False
    for message in status_info.get("messages", []):
        if not (isinstance(message, (list, tuple)) and len(message) >= 2 and isinstance(message[1], dict)):
            continue
        event, data = message[0], message[1]
        if event == "execution_start":
            started = data.get("timestamp")
        elif event in ("execution_success", "execution_error", "execution_interrupted"):
            ended = data.get("timestamp")
            error = data if event == "execution_error" else error
            interrupted = interrupted or event == "execution_interrupted"
    status = (CANCELLED if interrupted else FAILED) if status_info.get("status_str") == "error" else COMPLETED
    outputs = entry.get("outputs", {})
    count, preview = _outputs_summary(outputs)
    job = _pruned({"id": prompt_id, "status": status, "priority": number, "create_time": extra_data.get("create_time"),
                   "execution_start_time": started, "execution_end_time": ended, "execution_error": error,
                   "outputs_count": count, "preview_output": preview, "workflow_id": _workflow_id(extra_data)})
    if include_outputs:
        job["outputs"] = _outputs(outputs)
        job["execution_status"] = status_info
        job["workflow"] = {"prompt": graph, "extra_data": extra_data}
    return job


def page(jobs: list[dict[str, Any]], offset: int, limit: int | None) -> dict[str, Any]:
    """`GET /api/jobs`: one page of `jobs` (already filtered and sorted)."""
    chosen = jobs[offset:] if limit is None else jobs[offset:offset + limit]
    return {"jobs": chosen, "pagination": {"offset": offset, "limit": limit, "total": len(jobs),
                                           "has_more": offset + len(chosen) < len(jobs)}}


def listing(running: list[list[Any]], pending: list[list[Any]], history: list[tuple[str, dict[str, Any]]],
            query: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    """``GET /api/jobs`` over queue items and history entries: (HTTP status, body), with ComfyUI's
    filters (``status``, ``workflow_id``), sorting (``sort_by`` created_at|execution_duration,
    ``sort_order``) and paging (``limit``, ``offset``), and its 400s for bad values."""
    return listing_of(running, pending, [from_history(pid, entry) for pid, entry in history], query)


def listing_of(running: list[list[Any]], pending: list[list[Any]], finished: list[dict[str, Any]],
               query: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    """``listing`` over the finished prompts' jobs records (``from_history``) already made."""
    wanted = [s.strip().lower() for s in query.get("status", "").split(",") if s.strip()] or list(STATUSES)
    bad = [s for s in wanted if s not in STATUSES]
    if bad:
        return 400, {"error": f"Invalid status value(s): {', '.join(bad)}. Valid values: {', '.join(STATUSES)}"}
    sort_by, order = query.get("sort_by", "created_at").lower(), query.get("sort_order", "desc").lower()
    if sort_by not in ("created_at", "execution_duration"):
        return 400, {"error": "sort_by must be 'created_at' or 'execution_duration'"}
    if order not in ("asc", "desc"):
        return 400, {"error": "sort_order must be 'asc' or 'desc'"}
    limit = None
    if "limit" in query:
        try:
            limit = int(query["limit"])
        except ValueError:
            return 400, {"error": "limit must be an integer"}
        if limit <= 0:
            return 400, {"error": "limit must be a positive integer"}
    try:
        offset = max(int(query.get("offset", "0")), 0)
    except ValueError:
        return 400, {"error": "offset must be an integer"}
    jobs = ([from_queue(item, IN_PROGRESS) for item in running] if IN_PROGRESS in wanted else []) \
        + ([from_queue(item, PENDING) for item in pending] if PENDING in wanted else [])
    jobs += [job for job in finished if job["status"] in wanted]
    workflow = query.get("workflow_id")
    if workflow:
        jobs = [job for job in jobs if job.get("workflow_id") == workflow]

    def key(job: dict[str, Any]) -> float:
        if sort_by == "execution_duration":
            start, end = job.get("execution_start_time", 0), job.get("execution_end_time", 0)
            return float(end - start) if end and start else 0.0
        return float(job.get("create_time", 0))

    jobs.sort(key=key, reverse=order == "desc")
    return 200, page(jobs, offset, limit)


def find(job_id: str, running: list[list[Any]], pending: list[list[Any]],
         history: Mapping[str, dict[str, Any]]) -> dict[str, Any] | None:
    """``GET /api/jobs/{id}``: a finished job (with its outputs) first, then a running or queued one."""
    if job_id in history:
        return from_history(job_id, history[job_id], include_outputs=True)
    for items, status in ((running, IN_PROGRESS), (pending, PENDING)):
        for item in items:
            if len(item) > 1 and item[1] == job_id:
                return from_queue(item, status)
    return None
