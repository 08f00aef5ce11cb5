"""A ComfyUI prompt's overall progress, from its frames: the ``step_progress`` of a job.

ComfyUI's ``progress`` restarts at 1 for each node that reports progress (two samplers, an
upscaler), so passing it through makes a job's bar go backwards. The overall progress counts
steps over the whole prompt instead: a node's share is its ``max`` once it reports one, and
before that the ``steps`` input it was given (how KSampler and most progress-reporting nodes
are driven), so a later sampler is counted from the start. ``progress_state`` (sent at each
node's start, on progress and at its finish) says which nodes ran; without it, node order does
(a node that starts means the ones before it finished). Never backwards: a reading that would
lower the percentage (a node reporting steps nobody announced) is not reported.
"""

from __future__ import annotations

from typing import Any, TypeGuard


def _num(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Progress:
    __slots__ = ("_done", "_last", "_order", "_ran", "_weight")

    def __init__(self, graph: Any):
        self._weight: dict[str, float] = {}
        self._done: dict[str, float] = {}
        self._order: list[str] = []  # nodes in the order they started
        self._last: tuple[float, float, int] | None = None  # (step, total, pct) last reported
        self._ran: dict[str, float] = {}  # per node, the highest step it reported in this attempt
        for nid, node in (graph.items() if isinstance(graph, dict) else ()):
            inputs = node.get("inputs") if isinstance(node, dict) else None
            steps = inputs.get("steps") if isinstance(inputs, dict) else None
            if _num(steps) and steps > 0:
                self._weight[str(nid)] = float(steps)

    # --- what the node says ---------------------------------------------------------------
    def started(self, nid: Any) -> None:
        """``executing`` a node: in ComfyUI's sequential run, every node started before is done."""
        if not isinstance(nid, str):
            return
        for prev in self._order:
            if prev != nid:
                self._finish(prev)
        if nid not in self._order:
            self._order.append(nid)

    def cached(self, nodes: Any) -> None:
        for nid in nodes if isinstance(nodes, list) else ():
            if isinstance(nid, str):
                self._finish(nid)

    def step(self, nid: Any, value: Any, maximum: Any) -> None:
        """A ``progress`` frame."""
        if not (_num(value) and _num(maximum) and maximum > 0):
            return
        nid = nid if isinstance(nid, str) else "?"
        self.started(nid)
        self._weight[nid] = float(maximum)
        self._done[nid] = float(min(value, maximum))
        self._ran[nid] = max(self._ran.get(nid, 0.0), float(min(value, maximum)))

    def state(self, nodes: Any) -> None:
        """A ``progress_state`` frame: every node of the prompt seen so far, with its state."""
        if not isinstance(nodes, dict):
            return
        for nid, st in nodes.items():
            if not isinstance(st, dict):
                continue
            if nid not in self._order:
                self._order.append(nid)
            if st.get("state") == "finished":
                self._finish(nid)
                continue
            value, maximum = st.get("value"), st.get("max")
            # A node's first frame is 0/1 whatever it will report: only a real max counts.
            if _num(value) and _num(maximum) and maximum > 1:
                self._weight[nid] = float(maximum)
                self._done[nid] = float(min(value, maximum))

    def _finish(self, nid: str) -> None:
        w = self._weight.get(nid)
        if w is not None:
            self._done[nid] = w

    # --- what the node did (its speed) ---------------------------------------------------------
    def attempt(self) -> None:
        """A new attempt on a node: the steps another node ran do not count for this one."""
        self._ran.clear()

    def steps_ran(self) -> float:
        """Sampler steps the node reported running in this attempt (``progress`` frames): the
        unit of work its speed is measured in (cached nodes ran none)."""
        return sum(self._ran.values())

    # --- what the job reports -------------------------------------------------------------
    def report(self) -> tuple[int | float, int | float] | None:
        """(step, total) when the overall progress moved forward since the last report, else None."""
        total = sum(self._weight.values())
        if total <= 0:
            return None
        step = sum(self._done.get(n, 0.0) for n in self._weight)
        if step <= 0:
            return None
        pct = int(step * 100 // total)
        last = self._last
        if last is not None and (pct < last[2] or (step, total) == last[:2]):
            return None
        self._last = (step, total, pct)
        return _int(step), _int(total)


def _int(x: float) -> int | float:
    return int(x) if x == int(x) else round(x, 3)
