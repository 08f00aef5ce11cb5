"""What a multi-model node serves and holds loaded (docs/CONFIG.md#multi-model-nodes).

Pure: no I/O, no clock. The scheduler asks whether a node serves a model and whether the model
is warm there, and tells it each dispatch; the health side (``health.refresh_models``) feeds in
what the node itself answers (``GET /v1/models``; llama-swap ``GET /running``, Ollama
``GET /api/ps``). A node without ``models`` has no model state: it takes any model and no
dispatch to it is a swap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kilolined.core.config import NodeConfig

#: llama-swap's and Ollama's "which models are loaded" endpoints, relative to the node's url
WARM_PATHS = ("/running", "/api/ps")


@dataclass(slots=True)
class ModelState:
    #: the node's own model list (``models: discover``); None until it has answered once
    discovered: tuple[str, ...] | None = None
    #: the models loaded now, least recently dispatched first; None while unknown
    warm: list[str] | None = None
    #: dispatches so far: an observation of the warm set taken before the last dispatch is stale
    dispatches: int = 0
    #: where the node tells its loaded models (WARM_PATHS); None: not known yet, (): it tells neither
    warm_paths: tuple[str, ...] | None = None

    def listed(self, cfg: NodeConfig) -> list[str] | None:
        """The models the node serves; None when it declares none, or has not told them yet."""
        if isinstance(cfg.models, list):
            return cfg.models
        return None if self.discovered is None else list(self.discovered)

    def serves(self, cfg: NodeConfig, model: str | None) -> bool:
        """Whether the node may take a request for ``model``. A request naming no model, a node
        declaring no models, and a discovering node that has not answered yet all say yes: the
        node itself is the judge then."""
        if model is None:
            return True
        names = cfg.rewrite.model if cfg.rewrite is not None else None
        if names:
            if cfg.models is None:
                return model in names  # a hosted API's names: what its rewrite.model maps
            model = names.get(model, model)
        if cfg.models is None:
            return True
        listed = cfg.models if isinstance(cfg.models, list) else self.discovered
        return listed is None or model in listed

    def is_warm(self, model: str | None) -> bool:
        return model is not None and self.warm is not None and model in self.warm

    def would_swap(self, cfg: NodeConfig, model: str | None) -> bool:
        """Sending ``model`` here now makes the node load it (a known warm set without it)."""
        return cfg.models is not None and model is not None and self.warm is not None and model not in self.warm

    def dispatch(self, cfg: NodeConfig, model: str | None) -> bool | None:
        """A request for ``model`` was leased here; returns whether it is a swap (None: the node
        has no model state). The first dispatch to a node whose warm set is unknown is no swap."""
        if cfg.models is None:
            return None
        self.dispatches += 1
        if model is None:
            return False
        swap = self.warm is not None and model not in self.warm
        warm = [m for m in self.warm or () if m != model]
        warm.append(model)
        self.warm = warm[-cfg.warm_models:]
        return swap

    def observe_served(self, ids: Sequence[str]) -> None:
        self.discovered = tuple(dict.fromkeys(ids))

    def observe_warm(self, ids: Sequence[str], since: int) -> bool:
        """The node said which models it holds, in a probe sent after ``since`` dispatches.

        Ignored when a dispatch happened meanwhile: the node may not have started the swap that
        dispatch causes, and the gateway's own record is newer. Returns whether it was applied."""
        if since != self.dispatches:
            return False
        self.warm = list(dict.fromkeys(ids))
        return True


def running_models(doc: object) -> list[str] | None:
    """The loaded models in a llama-swap ``GET /running`` or Ollama ``GET /api/ps`` answer;
    None when ``doc`` is neither shape (docs/BACKENDS.md#multi-model-servers).

    llama-swap: ``{"running": [{"model": id, "state": "ready" | "starting" | "stopping", …}]}``
    (a process that is stopping is leaving: not warm). Ollama: ``{"models": [{"name": …,
    "model": …, …}]}``."""
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("running"), list):
        return [e["model"] for e in doc["running"]
                if isinstance(e, dict) and isinstance(e.get("model"), str) and e.get("state") != "stopping"]
    if isinstance(doc.get("models"), list):
        out = []
        for e in doc["models"]:
            if isinstance(e, dict):
                name = e.get("model") if isinstance(e.get("model"), str) else e.get("name")
                if isinstance(name, str):
                    out.append(name)
        return out
    return None


def model_ids(doc: object) -> list[str] | None:
    """The ids of an OpenAI ``GET /v1/models`` list; None when ``doc`` is not one."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
