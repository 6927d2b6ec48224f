"""Screenshots of every notebook's views, as JupyterLab draws them, for docs/screens/.

    python3 scripts/notebook_screens.py docs/screens gpt-oss=FOLDER qwen3.5=FOLDER

Each FOLDER is a checkpoint with a tokenizer (e.g. `moebench make-random --preset gpt-oss-tiny FOLDER`). For each, a
JupyterLab server opens the committed notebooks (through the project's output filter) with MOEBENCH_MODEL=FOLDER, so
the picker's default is that model; each notebook is run whole in headless Chromium (Debian's, as the browser tests
use), the code and prose hidden, and its outputs saved as NN-NAME-K.png, cut between cells into parts of at most
PART_PX pixels so that each stays a small file. Look at every picture before committing it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
WIDTH, PART_PX = 1120, 900
# Only the outputs: no code, no prose, no prompts.
OUTPUTS_ONLY_CSS = (".jp-MarkdownCell, .jp-Cell-inputWrapper, .jp-OutputPrompt, .jp-Toolbar, .jp-cell-toolbar "
                    "{ display: none !important; } .jp-Notebook { padding: 4px !important; }")
DONE_JS = """() => {
    const panel = window.jupyterapp.shell.currentWidget;
    const cells = panel.content.widgets.filter(c => c.model.type === 'code');
    const plots = [...document.querySelectorAll('.jp-OutputArea-output > .jupyter-widgets .js-plotly-plot')];
    return cells.every(c => c.model.executionCount !== null) && panel.sessionContext.session.kernel.status === 'idle'
        && ![...document.querySelectorAll('.jp-OutputArea-output')].some(e => e.textContent.includes('Loading widget'))
        && plots.every(p => p.querySelector('.main-svg'));
}"""
# The notebook's code cells, top and bottom in the page: where a part may end.
CELLS_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell')]
    .map(c => c.getBoundingClientRect()).filter(r => r.height > 0).map(r => [r.top, r.bottom])"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab(folder: Path, model: Path):
    """A JupyterLab server over the committed notebooks, its picker's default `model`; returns (process, url)."""
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        text = subprocess.run([sys.executable, "-m", "nbstripout", "-t", str(nb)], check=True, capture_output=True,
                              text=True).stdout
        (folder / nb.name).write_text(text)
    settings = folder / ".settings" / "@jupyterlab"
    for plugin, values in (("notebook-extension/tracker", {"windowingMode": "none"}),
                           ("apputils-extension/notification", {"fetchNews": "false", "checkForUpdates": False})):
        (settings / f"{plugin}.jupyterlab-settings").parent.mkdir(parents=True, exist_ok=True)
        (settings / f"{plugin}.jupyterlab-settings").write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={folder}", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.user_settings_dir={folder / '.settings'}", f"--LabApp.workspaces_dir={folder / '.workspaces'}",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(folder / ".jupyter"), "MOEBENCH_MODEL": str(model)})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            return server, base, token
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("JupyterLab did not start") from None
            time.sleep(0.5)


def parts(cells: list[list[float]], top: float, bottom: float) -> list[tuple[float, float]]:
    """[top, bottom) spans of at most PART_PX, each ending between two cells (or where a cell taller than a part
    must be cut)."""
    spans, start = [], top
    while bottom - start > PART_PX:
        ends = [b for _, b in cells if start < b <= start + PART_PX]
        end = max(ends) if ends and max(ends) > start + PART_PX / 3 else start + PART_PX
        spans.append((start, end))
        start = end
    return [*spans, (start, bottom)] if bottom - start >= 1 else spans


def shoot(page, base: str, token: str, notebook: str, out: Path, name: str) -> list[Path]:
    page.goto(f"{base}/lab/tree/{notebook}?token={token}&reset", wait_until="domcontentloaded")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel", timeout=120_000)
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(DONE_JS, timeout=600_000, polling=500)
    page.add_style_tag(content=OUTPUTS_ONLY_CSS)
    for _ in range(5):  # a taller window lays out more of the notebook: until all of it fits
        page.evaluate("() => document.querySelectorAll('.jp-NotebookPanel-notebook, .jp-WindowedPanel-outer')"
                      ".forEach(e => { e.scrollTop = 0; })")  # the notebook from its top
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        needed = int(page.evaluate(CELLS_JS)[-1][1] + 100)
        if needed <= page.viewport_size["height"]:
            break
        page.set_viewport_size({"width": WIDTH, "height": needed})
    box = page.locator(".jp-Notebook").bounding_box()
    cells = page.evaluate(CELLS_JS)
    top, bottom = cells[0][0], cells[-1][1]
    written = []
    stem = notebook[:2]
    for i, (start, end) in enumerate(parts(cells, top, bottom), start=1):
        path = out / f"{stem}-{name}-{i}.png"
        page.screenshot(path=str(path), clip={"x": box["x"], "y": start, "width": box["width"], "height": end - start})
        written.append(path)
    page.set_viewport_size({"width": WIDTH, "height": 900})
    return written


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not all("=" in a for a in argv[1:]):
        raise SystemExit(__doc__)
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                          "--disable-component-update", "--disable-sync", "--no-first-run"])
        for name, folder in (a.split("=", 1) for a in argv[1:]):
            with tempfile.TemporaryDirectory() as work:
                server, base, token = lab(Path(work), Path(folder).resolve())
                try:
                    page = browser.new_page(viewport={"width": WIDTH, "height": 900})
                    for notebook in notebooks:
                        for path in shoot(page, base, token, notebook, out, name):
                            print(f"{path} {path.stat().st_size // 1024} KB")
                    page.close()
                finally:
                    server.terminate()
                    server.wait(timeout=30)
        browser.close()


if __name__ == "__main__":
    main(sys.argv[1:])
