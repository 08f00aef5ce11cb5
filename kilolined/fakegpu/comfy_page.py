"""The fake ComfyUI's web UI: a page small enough to read, built the way ComfyUI's frontend
(comfyui_frontend_package) is, where a gateway depends on it.

- ``index.html`` names its files relatively (``./assets/…``), so it works under any prefix that
  ends in a slash;
- the script finds the API as the real one does (``api_base`` = the page's path without its last
  segment), opens ``{api_base}/ws?clientId=…`` and sends ``feature_flags`` first, posts to
  ``{api_base}/api/prompt`` with its client id, and shows each prompt's progress, previews and
  image (``/api/view``) from the socket's events;
- the stylesheet and the script hold root-absolute URLs (``/assets/images/…``), as the real
  bundle does for its logos;
- the script and the stylesheet have content-hashed names (``assets/index-<hash>.js``, Vite's
  ``<name>-<hash>.<ext>``, the hash 8 characters of base64url), the images under
  ``assets/images/`` plain ones;
- every answer has the Cache-Control of ComfyUI's middleware/cache_middleware.py (``no-store`` on
  each ``.js``/``.css``/``index*.json``, a day or an hour on an image), which
  tests/test_comfy_real_shapes.py runs against these same handlers.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

INDEX = """<!doctype html><html lang="en"><head><meta charset="UTF-8"/><title>ComfyUI</title>
<link rel="stylesheet" href=".{style}"/>
<script type="module" src=".{script}"></script></head>
<body><div id="logo"></div><div id="queue">queue: <span id="remaining">?</span></div>
<button id="queue-button">Queue</button><div id="previews">0</div><ul id="prompts"></ul></body></html>
"""

CSS = """body { font-family: sans-serif; }
#logo { width: 16px; height: 16px; background: url(/assets/images/logo.svg); }
"""

LOGO = """<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16"><rect width="16" height="16"
fill="#fc0"/></svg>"""

JS = """const apiBase = location.pathname.split('/').slice(0, -1).join('/');
const clientId = 'page-' + Math.random().toString(16).slice(2);
const steps = Number(new URLSearchParams(location.search).get('steps') || '5');
let seed = Date.now();
window.comfyPage = { apiBase, clientId, prompts: {}, previews: 0, statuses: 0, socketOpen: false };
const logo = document.createElement('img');
logo.id = 'logo-img';
logo.src = '/assets/images/logo.svg';
document.body.appendChild(logo);

function row(pid) {
  let li = document.getElementById('p-' + pid);
  if (!li) {
    li = document.createElement('li');
    li.id = 'p-' + pid;
    li.innerHTML = '<span class="progress"></span> <span class="state">queued</span> <img class="image">';
    document.getElementById('prompts').appendChild(li);
    window.comfyPage.prompts[pid] = { progress: [], done: false, image: null };
  }
  return li;
}

const ws = new WebSocket((location.protocol === 'https:' ? 'wss://' : 'ws://') + location.host + apiBase +
                         '/ws?clientId=' + clientId);
ws.binaryType = 'arraybuffer';
ws.onopen = () => {
  window.comfyPage.socketOpen = true;
  ws.send(JSON.stringify({ type: 'feature_flags', data: { supports_preview_metadata: true } }));
};
ws.onmessage = (ev) => {
  if (typeof ev.data !== 'string') {
    window.comfyPage.previews += 1;
    document.getElementById('previews').textContent = String(window.comfyPage.previews);
    return;
  }
  const msg = JSON.parse(ev.data), d = msg.data;
  if (msg.type === 'status') {
    window.comfyPage.statuses += 1;
    document.getElementById('remaining').textContent = String(d.status.exec_info.queue_remaining);
    return;
  }
  if (!d.prompt_id) return;
  const li = row(d.prompt_id), rec = window.comfyPage.prompts[d.prompt_id];
  if (msg.type === 'progress') {
    rec.progress.push(d.value);
    li.querySelector('.progress').textContent = d.value + '/' + d.max;
  } else if (msg.type === 'executed' && d.output.images) {
    const im = d.output.images[0];
    const img = li.querySelector('.image');
    img.src = apiBase + '/api/view?' + new URLSearchParams({ filename: im.filename, subfolder: im.subfolder,
                                                             type: im.type });
    rec.image = img.src;
  } else if (msg.type === 'execution_success') {
    rec.done = true;
    li.querySelector('.state').textContent = 'done';
  }
};

document.getElementById('queue-button').onclick = async () => {
  seed += 1;
  const prompt = {
    '4': { class_type: 'CheckpointLoaderSimple', inputs: { ckpt_name: 'x.safetensors' } },
    '5': { class_type: 'EmptyLatentImage', inputs: { width: 512, height: 512, batch_size: 1 } },
    '6': { class_type: 'CLIPTextEncode', inputs: { text: 'a cat', clip: ['4', 1] } },
    '7': { class_type: 'CLIPTextEncode', inputs: { text: '', clip: ['4', 1] } },
    '3': { class_type: 'KSampler', inputs: { model: ['4', 0], positive: ['6', 0], negative: ['7', 0],
                                             latent_image: ['5', 0], seed, steps } },
    '8': { class_type: 'VAEDecode', inputs: { samples: ['3', 0], vae: ['4', 2] } },
    '9': { class_type: 'SaveImage', inputs: { images: ['8', 0], filename_prefix: 'ComfyUI' } },
  };
  const r = await fetch(apiBase + '/api/prompt', { method: 'POST', headers: { 'Content-Type': 'application/json' },
                                                   body: JSON.stringify({ prompt, client_id: clientId }) });
  const answer = await r.json();
  row(answer.prompt_id);
};
"""


def hashed(name: str, ext: str, body: str) -> str:
    """``/assets/<name>-<hash>.<ext>``, the hash of the content as Vite names a bundle's files."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).decode()
    return f"/assets/{name}-{digest[:8]}.{ext}"


SCRIPT = hashed("index", "js", JS)
STYLE = hashed("index", "css", CSS)
LOGO_PATH = "/assets/images/logo.svg"
PAGE = INDEX.format(style=STYLE, script=SCRIPT)
IMAGES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def cache_control(path: str, status: int) -> str | None:
    """The Cache-Control ComfyUI's middleware gives an answer it has none for: no-store for scripts,
    styles and ``index*.json`` (the real one serves extensions' scripts under fixed names), a day
    for an image (an hour for its 404, none for a 304 or another status)."""
    last = path.rsplit("/", 1)[-1]
    if path.endswith((".js", ".css")) or (last.startswith("index") and last.endswith(".json")):
        return "no-store"
    if not path.lower().endswith(IMAGES):
        return None
    if status == 404:
        return "public, max-age=3600"
    if status in (200, 201, 202, 203, 204, 205, 206, 301, 308):
        return "public, max-age=86400"
    return "no-cache" if status in (302, 303, 307) else None


async def _cache_headers(request: web.Request, response: web.StreamResponse) -> None:
    value = cache_control(request.path, response.status)
    if value is not None:
        response.headers.setdefault("Cache-Control", value)


def _serve(body: str, content_type: str, no_store: bool = False) -> Handler:
    async def handler(_: web.Request) -> web.Response:
        resp = web.Response(text=body, content_type=content_type)
        if no_store:
            resp.headers["Cache-Control"] = "no-store, must-revalidate"  # as ComfyUI's get_root
        return resp

    return handler


def add_page_routes(app: web.Application) -> None:
    """``/`` and its files, at the root as ComfyUI serves them (static files have no ``/api`` form)."""
    app.router.add_get("/", _serve(PAGE, "text/html", no_store=True))
    app.router.add_get(SCRIPT, _serve(JS, "application/javascript"))
    app.router.add_get(STYLE, _serve(CSS, "text/css"))
    app.router.add_get(LOGO_PATH, _serve(LOGO, "image/svg+xml"))


def add_cache_headers(app: web.Application) -> None:
    """Every answer's Cache-Control as ComfyUI's cache middleware sets it (404s included)."""
    app.on_response_prepare.append(_cache_headers)
