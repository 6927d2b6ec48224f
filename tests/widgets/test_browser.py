"""Real-browser test: every notebook runs in JupyterLab in headless Chromium and its widgets render.

One JupyterLab server (127.0.0.1, a token, a free port) serves copies of the notebooks (so the repo's
stripped notebooks never receive outputs). For each notebook: open, run all cells, wait, then fail on
any JavaScript console error, any error output, or any widget that did not render. Notebook 04 also
gets its fused toggle clicked, and the backend label and the tok/s chart must change. Screenshots of
every widget land in artifacts/browser/ (git-ignored).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = ROOT / "artifacts" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
NOTEBOOK_TIMEOUT_S = 120
# Text a widget output shows when its view failed or never arrived.
# How many widget views the notebook's outputs hold (the kernel's side of the story).
WIDGET_OUTPUTS_JS = """() => {
    const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
    let n = 0;
    for (let i = 0; i < cells.length; i++) {
        const outputs = cells.get(i).outputs;
        if (!outputs) continue;
        for (let j = 0; j < outputs.length; j++) {
            if (outputs.get(j).data['application/vnd.jupyter.widget-view+json']) n++;
        }
    }
    return n;
}"""
UNRENDERED = ("Error displaying widget", "Loading widget", "Failed to load model class", "Model not found")

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (scripts/setup.sh does)", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server over a copy of notebooks/; yields (base url, token, folder); stopped at the end."""
    work = tmp_path_factory.mktemp("lab")
    for nb in NOTEBOOKS:
        shutil.copy(nb, work / nb.name)
    # Render every cell (no virtual scrolling), so every widget is in the DOM to be checked; no news pop-up.
    for plugin, values in (("notebook-extension/tracker", {"windowingMode": "none"}),
                           ("apputils-extension/notification", {"fetchNews": "false", "checkForUpdates": False})):
        path = work / ".settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    log = (work / "lab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.user_settings_dir={work / '.settings'}", f"--LabApp.workspaces_dir={work / '.workspaces'}",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly", *(["--allow-root"] if os.geteuid() == 0 else [])],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JUPYTER_CONFIG_DIR": str(work / ".jupyter")},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start; log:\n{(work / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield base, token, work
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Debian Chromium with a fresh profile folder (Playwright's own browsers are never installed)."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1800},
        )
        yield context
        context.close()


KERNEL_IDLE_JS = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session
        && panel.sessionContext.session.kernel;
    return kernel && kernel.status === 'idle';
}"""


def run_all_cells(page) -> None:
    page.wait_for_function(KERNEL_IDLE_JS, timeout=60_000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # Done when every code cell has an execution count and the kernel is idle again.
    page.wait_for_function(
        """() => {
            const panel = window.jupyterapp.shell.currentWidget;
            const cells = panel.content.widgets.filter(c => c.model.type === 'code');
            return cells.every(c => c.model.executionCount !== null)
                && panel.sessionContext.session.kernel.status === 'idle';
        }""", timeout=NOTEBOOK_TIMEOUT_S * 1000, polling=500)


@pytest.mark.parametrize("notebook", [nb.name for nb in NOTEBOOKS])
def test_notebook_renders_in_chromium(lab, browser, notebook):
    base, token, _ = lab
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    stem = notebook.removesuffix(".ipynb")
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        page.goto(f"{base}/lab/tree/{notebook}?token={token}&reset", wait_until="domcontentloaded")
        run_all_cells(page)
        failed = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
        assert failed.count() == 0, f"{notebook}: a cell raised:\n{failed.first.inner_text()[:3000]}"
        page.wait_for_timeout(1500)  # let plotly finish its first layout
        expected = page.evaluate(WIDGET_OUTPUTS_JS)
        assert expected > 0, f"{notebook}: no widget was displayed"
        outputs = page.locator(".jp-OutputArea-output")
        for i in range(outputs.count()):
            text = outputs.nth(i).inner_text()
            bad = [u for u in UNRENDERED if u in text]
            assert not bad, f"{notebook}: output {i} shows {bad[0]!r}: a widget did not render"
        views = page.locator(".jp-OutputArea-output > .jupyter-widgets, .jp-OutputArea-output > .js-plotly-plot")
        assert views.count() == expected, f"{notebook}: {expected} widgets displayed, {views.count()} rendered"
        for i in range(views.count()):
            view = views.nth(i)
            view.scroll_into_view_if_needed()
            box = view.bounding_box()
            assert box and box["height"] > 10, f"{notebook}: widget {i} rendered empty"
            view.screenshot(path=str(ARTIFACTS / f"{stem}-widget{i:02d}.png"))
        assert page.locator(".js-plotly-plot").count() > 0, f"{notebook}: no plotly figure rendered"
        if page.locator(".moebench-token-strip").count():
            scrub_while_kernel_busy(page, stem)
        if page.locator(".moebench-fused-toggle").count():
            click_fused_toggle(page, stem)
        page.screenshot(path=str(ARTIFACTS / f"{stem}-page.png"))
        assert not errors, f"{notebook}: JavaScript errors:\n" + "\n".join(errors)
    finally:
        page.close()


def scrub_while_kernel_busy(page, stem: str) -> None:
    """With the kernel stuck in a sleep, clicking a token must still move the slider and the highlight:
    the stepper's play widget, slider and strip are linked in the browser, not through Python."""
    stepper = page.locator(".moebench-stepper").first
    router_title = page.locator(".js-plotly-plot .gtitle", has_text="routing of token").first
    title_before = router_title.text_content()
    spans = stepper.locator(".moebench-token-strip span[title^='step ']")
    target = spans.count() - 1
    assert target > 0, f"{stem}: the token strip shows fewer than two steps"
    page.evaluate("""() => {
        const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
        window.moebenchSleep = {started: false, done: false};
        const future = kernel.requestExecute({code: 'import time; time.sleep(30)'});
        future.onIOPub = (msg) => {
            if (msg.header.msg_type === 'execute_input') window.moebenchSleep.started = true;
        };
        future.done.then(() => { window.moebenchSleep.done = true; });
    }""")
    page.wait_for_function("() => window.moebenchSleep.started", timeout=20_000)
    spans.nth(target).click()
    readout = stepper.locator(".widget-readout").first
    page.wait_for_function("([el, want]) => el.innerText.trim() === want", arg=[readout.element_handle(), str(target)],
                           timeout=3_000)
    assert "outline" in (spans.nth(target).get_attribute("style") or "")
    sleeping = page.evaluate("() => !window.moebenchSleep.done")
    assert sleeping, f"{stem}: the kernel finished its sleep before the scrub was checked; the check proves nothing"
    stepper.screenshot(path=str(ARTIFACTS / f"{stem}-scrubbed.png"))
    page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.interrupt()")
    # Once the kernel is free, the Python views catch up with the step chosen in the browser.
    page.wait_for_function("([el, text]) => el.textContent !== text", arg=[router_title.element_handle(), title_before],
                           timeout=30_000)
    page.wait_for_function(KERNEL_IDLE_JS, timeout=30_000)


def click_fused_toggle(page, stem: str) -> None:
    """Click the toggle: the label must report the other path and a tok/s chart, if any, must gain a marker."""
    toggle = page.locator(".moebench-fused-toggle").last
    label = page.locator(".moebench-backend-label").last
    charts = page.locator(".js-plotly-plot.moebench-tps-chart")
    chart = charts.last if charts.count() else None
    before_label = label.inner_text()
    before_marks = chart.locator(".annotation-text").count() if chart else 0
    toggle.scroll_into_view_if_needed()
    toggle.click()
    page.wait_for_function("([el, text]) => el.innerText !== text", arg=[label.element_handle(), before_label],
                           timeout=30_000)
    after_label = label.inner_text()
    assert ("fallback" in after_label) != ("fallback" in before_label), (before_label, after_label)
    toggle.locator("xpath=..").screenshot(path=str(ARTIFACTS / f"{stem}-after-toggle.png"))
    if chart:
        page.wait_for_function("([el, n]) => el.querySelectorAll('.annotation-text').length > n",
                               arg=[chart.element_handle(), before_marks], timeout=30_000)
        chart.screenshot(path=str(ARTIFACTS / f"{stem}-chart-after-toggle.png"))
