"""ComfyUI's real web UI, through a gateway route, over real ComfyUI servers, in headless Chromium.

Loads ``{gateway}{path}`` (without its slash: the redirect is part of the check) with the key sent
as a header, waits for the app, queues two prompts of the weight-free ``KLSlowProgress`` node
(scripts/real_backends_setup.sh installs it) and prints, per prompt, the websocket events the page
received through the gateway's one socket, the output images it shows, and its console errors.
Which node ran each prompt: ask the nodes' own ``/history``.

    python scripts/check_comfy_web_ui.py http://127.0.0.1:8290 /comfy "$ALICE_KEY" [steps] [step_ms]

Needs /usr/bin/chromium, /usr/bin/chromedriver and selenium.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

# Every frame the page's own socket receives: (type, prompt id), recorded before the app runs.
RECORD = """
window.__ws = [];
const WS = window.WebSocket;
window.WebSocket = class extends WS { constructor(u, p) { super(u, p); window.__wsurl = String(u);
  this.addEventListener('message', (ev) => {
    if (typeof ev.data !== 'string') { window.__ws.push(['binary', null]); return; }
    const m = JSON.parse(ev.data); window.__ws.push([m.type, (m.data && m.data.prompt_id) || null]); }); } };
"""
READY = "return !!(window.app && window.app.graph && !document.querySelector('#splash-loader'))"
QUEUE = ("const cb = arguments[arguments.length - 1];"
         "window.app.loadApiJson(arguments[0], 'kl.json');"
         "setTimeout(() => window.app.queuePrompt(0, 1).then(() => cb('ok'), (e) => cb(String(e))), 500);")


def wait(driver: Any, script: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if driver.execute_script(script):
            return True
        time.sleep(0.2)
    return False


def main(gateway: str, path: str, key: str, steps: int = 30, step_ms: int = 250) -> int:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,900"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    driver.set_script_timeout(60)
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Bearer {key}"}})
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD})
        started = time.monotonic()
        driver.get(gateway + path)
        ready = wait(driver, READY, 90)
        print(f"landed on {driver.current_url}; app ready: {ready} after {time.monotonic() - started:.1f}s; "
              f"socket {driver.execute_script('return window.__wsurl')}")
        for seed in (1, 2):
            prompt = {"1": {"class_type": "KLSlowProgress",
                            "inputs": {"steps": steps, "step_ms": step_ms, "seed": int(time.time()) * 10 + seed}},
                      "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "kl"}}}
            print("queued:", driver.execute_async_script(QUEUE, prompt))
        wait(driver, "return window.__ws.filter(f => f[0] == 'execution_success').length >= 2",
             steps * step_ms / 1000 * 2 + 60)
        by_prompt: dict[str | None, dict[str, int]] = {}
        for kind, pid in driver.execute_script("return window.__ws"):
            counts = by_prompt.setdefault(pid, {})
            counts[kind] = counts.get(kind, 0) + 1
        for pid, counts in by_prompt.items():
            print(pid or "(no prompt id)", counts)
        images = driver.execute_script("return [...document.querySelectorAll('img')]"
                                       ".filter(i => i.src.includes('/view')).map(i => [i.src, i.naturalWidth])")
        print("images shown:", images)
        errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        print(f"console errors: {len(errors)}")
        for message in errors:
            print("  ", message[:200])
        return 0 if ready and sum("execution_success" in c for c in by_prompt.values()) >= 2 else 1
    finally:
        driver.quit()


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:6])))
