"""Real-browser tests: the notebooks in JupyterLab in headless Chromium, used as a user would.

One JupyterLab server (127.0.0.1, a token, a free port) serves the notebooks as committed: each is run through the
project's output filter (nbstripout), so the outputs and widget state a user saved in the working tree never reach a
test. Its kernels' model pickers offer the shipped model (the default) and a tiny checkpoint of each family people run
(Qwen3-MoE, OLMoE, gpt-oss, Qwen3.5, Qwen3-Next). JupyterLab 4.6 sends widget messages over kernel subshells, so
every click here reaches the kernel on a subshell thread, as it does for users.

No test waits for a length of time: each waits for the state it needs (the kernel idle, a view drawn, a title that
names the model picked), with a deadline only to fail by. Every test fails on a JavaScript error.

- every notebook: Run All, then no error output, every widget rendered, the static copies hidden while the live
  views show; one control per notebook changes its view; then each tiny family is picked in the model picker: every
  view follows it, or says it shows the last model and offers the run that measures the new one; no cell or widget
  fails, no message fails to serialize;
- 01's stepper scrubs while the kernel is busy (linked in the browser), and the router follows once it is free;
- 04's crash path (issue 22): flip the toggle while idle, during a decode run by a cell and during an
  awaited task, untick recording mid-run: no error, the records switch path between tokens;
- reload with the kernel running: the charts come back drawn, not as empty axes;
- save, shut the kernel down, reopen: every chart's static picture is there, and no widget error shows.

Screenshots land in $MOEBENCH_SHOTS (default artifacts/browser/, git-ignored).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from families import FAMILIES, write_family

from moebench.checkpoint.config import model_args
from moebench.checkpoint.loader import SHIPPED_MODEL
from moebench.tools.presets import get_preset

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = Path(os.environ.get("MOEBENCH_SHOTS") or ROOT / "artifacts" / "browser")
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
NOTEBOOK_TIMEOUT_S = 180
PLOTLY_MIME = "application/vnd.plotly.v1+json"
# The lab extensions the notebooks' views need: ipywidgets' manager (every control, anywidget's too) and plotly's.
LAB_EXTENSIONS = ("@jupyter-widgets/jupyterlab-manager", "jupyterlab-plotly")
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
def families(tmp_path_factory) -> dict[str, Path]:
    """A tiny checkpoint of each family in FAMILIES (8 experts, GLM-4.x and DeepSeek-V3 16), by the family's name."""
    root = tmp_path_factory.mktemp("families")
    return {name: write_family(root, preset) for name, preset in FAMILIES.items()}


def stripped(notebook: Path) -> str:
    """The notebook as committed: through the project's output filter (.gitattributes' nbstripout), whatever a run
    saved in the working tree (outputs, widget state: reopened, they made a test fail with 'model not found')."""
    return subprocess.run([sys.executable, "-m", "nbstripout", "-t", str(notebook)], check=True, capture_output=True,
                          text=True).stdout


@dataclass(frozen=True)
class Lab:
    base: str  # the server's address
    token: str
    folder: Path  # the notebooks it serves
    log: Path  # the server's and its kernels' output


def lab_extensions(base: str, token: str) -> set[str]:
    """The prebuilt extensions the lab page loads (its page config's federated_extensions)."""
    page = urllib.request.urlopen(f"{base}/lab?token={token}", timeout=30).read().decode()
    config = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S)
    assert config, "the lab page carries no jupyter-config-data"
    return {e["name"] for e in json.loads(config.group(1)).get("federated_extensions", [])}


@pytest.fixture(scope="module")
def lab(tmp_path_factory, families):
    """A JupyterLab server over the committed notebooks (stripped copies); yields a Lab; stopped at the end. Its
    kernels' model pickers offer the shipped model first (the default), then each tiny family."""
    work = tmp_path_factory.mktemp("lab")
    for nb in NOTEBOOKS:
        (work / nb.name).write_text(stripped(nb))
    # Render every cell (no virtual scrolling), so every widget is in the DOM to be checked; no news pop-up.
    for plugin, values in (("notebook-extension/tracker", {"windowingMode": "none"}),
                           ("apputils-extension/notification", {"fetchNews": "false", "checkForUpdates": False})):
        path = work / ".settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.user_settings_dir={work / '.settings'}", f"--LabApp.workspaces_dir={work / '.workspaces'}",
         "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly", *(["--allow-root"] if os.geteuid() == 0 else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JUPYTER_CONFIG_DIR": str(work / ".jupyter"),
             "MOEBENCH_MODEL": os.pathsep.join([str(SHIPPED_MODEL), *map(str, families.values())])},
    )
    base = f"http://127.0.0.1:{port}"
    serving = threading.Event()  # set when the server says where it serves, or when its output ends
    output = threading.Thread(target=tee_server_log, args=(server, work / "lab.log", f"{base}/", serving))
    output.start()
    try:
        serving.wait(timeout=300)  # a guard only: the server's own line (or its exit) ends the wait
        deadline = time.monotonic() + 60
        while not answers(f"{base}/api/status?token={token}"):  # it binds the port in its loop's first turn
            if server.poll() is not None or not serving.is_set() or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start; log:\n{(work / 'lab.log').read_text()[-3000:]}")
            os.sched_yield()
        missing = set(LAB_EXTENSIONS) - lab_extensions(base, token)
        if missing:
            pytest.fail(f"JupyterLab ({sys.executable}) found no {', '.join(sorted(missing))} extension: no widget or "
                        f"figure would render (its share/jupyter/labextensions is outside {sys.prefix}?)")
        yield Lab(base, token, work, work / "lab.log")
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        output.join()  # the server's output is closed: the log is whole
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(work / "lab.log", ARTIFACTS / "lab.log")  # the server's and the kernels' output, for a failure


def answers(url: str) -> bool:
    """Whether a server answers `url` now (False: nothing listens there yet)."""
    try:
        urllib.request.urlopen(url, timeout=30)
        return True
    except ConnectionRefusedError:
        return False
    except urllib.error.URLError as e:
        if isinstance(e.reason, ConnectionRefusedError):
            return False
        raise


def tee_server_log(server: subprocess.Popen, log: Path, address: str, serving: threading.Event) -> None:
    """Copy the server's output (its kernels' too) into `log` as it comes; set `serving` at the first line naming
    `address` (Jupyter Server logs it once it listens) and when the output ends (the server exited)."""
    with log.open("w") as out:
        for line in server.stdout:
            out.write(line)
            out.flush()
            if address in line:
                serving.set()
    serving.set()


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
# Run code in the notebook's kernel as a cell would (not waiting): window.moebenchRuns[name] gets its stdout.
EXECUTE_JS = """([name, code]) => {
    const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
    window.moebenchRuns = window.moebenchRuns || {};
    const run = window.moebenchRuns[name] = {started: false, done: false, out: '', error: null};
    const future = kernel.requestExecute({code});
    future.onIOPub = (msg) => {
        const t = msg.header.msg_type;
        if (t === 'execute_input') run.started = true;
        if (t === 'stream') run.out += msg.content.text;
        if (t === 'error') run.error = msg.content.ename + ': ' + msg.content.evalue;
    };
    future.done.then(() => { run.done = true; });
}"""


def execute(page, code: str, name: str = "run", wait: bool = True) -> str:
    """Run `code` in the kernel; with `wait`, return its stdout and fail on an error."""
    page.evaluate(EXECUTE_JS, [name, code])
    page.wait_for_function("(n) => window.moebenchRuns[n].started", arg=name, timeout=60_000)
    if not wait:
        return ""
    return finish(page, name)


def finish(page, name: str = "run") -> str:
    page.wait_for_function("(n) => window.moebenchRuns[n].done", arg=name, timeout=120_000)
    run = page.evaluate("(n) => window.moebenchRuns[n]", name)
    assert run["error"] is None, f"kernel raised {run['error']}"
    return run["out"]


def fresh_copy(lab, notebook: str, name: str) -> str:
    """The committed notebook under another name: its own kernel, with none of the widgets earlier tests made
    (widgets live until closed, and a reload fetches every one of them)."""
    (lab.folder / name).write_text(stripped(ROOT / "notebooks" / notebook))
    return name


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


def open_notebook(browser, lab, notebook: str, errors: list[str]):
    page = browser.new_page()
    page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e.stack or e}"))
    page.goto(f"{lab.base}/lab/tree/{notebook}?token={lab.token}&reset", wait_until="domcontentloaded")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=60_000)
    return page


def shot(page, name: str) -> None:
    """The whole notebook in one picture: the viewport made as tall as the notebook's content for it."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    size = page.viewport_size
    height = page.evaluate("() => { const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];"
                           " const top = cells.length ? cells[0].getBoundingClientRect().top : 0;"
                           " return cells.length ? cells[cells.length - 1].getBoundingClientRect().bottom - top : 0; }")
    page.set_viewport_size({"width": size["width"], "height": int(min(max(size["height"], height + 200), 16000))})
    page.evaluate("() => document.querySelectorAll('.jp-NotebookPanel-notebook, .jp-WindowedPanel-outer')"
                  ".forEach(e => { e.scrollTop = 0; })")
    next_frames(page)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))
    page.set_viewport_size(size)


def settled(page, js: str, arg=None, timeout_ms: int = 120_000) -> bool:
    """Wait until `js` holds in the page; False when the deadline passed first, for the assertions after it to say
    what is wrong."""
    try:
        page.wait_for_function(js, arg=arg, timeout=timeout_ms)
        return True
    except playwright_api.TimeoutError:
        return False


def poll(page, problem, timeout_s: float = 120) -> None:
    """Until `problem()` (what is wrong with the page, or None) is None, each time after the page drew two more
    frames; fails with the last problem when the deadline passes first."""
    deadline = time.monotonic() + timeout_s
    while (found := problem()) is not None and time.monotonic() < deadline:
        next_frames(page)
    assert found is None, found


def next_frames(page) -> None:
    """Wait until the page has drawn two more frames (a layout the last change asked for is on screen)."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


# Text no output may show: a traceback (in a stream or a widget's status), a message the kernel failed to serialize
FAILURES = ("Traceback (most recent call last)", "Message serialization failed", "not JSON compliant")


def no_error_outputs(page, notebook: str) -> None:
    failed = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
    assert failed.count() == 0, f"{notebook}: a cell raised:\n{failed.first.inner_text()[:3000]}"
    for status in page.locator("[class*='-status']").all():
        assert "Error:" not in status.inner_text(), f"{notebook}: a widget reported {status.inner_text()[:500]}"
    text = page.locator(".jp-Notebook").inner_text()
    found = [f for f in FAILURES if f in text]
    assert not found, f"{notebook}: an output shows {found[0]!r}:\n{text[text.index(found[0]) - 500:][:3000]}"


def no_serialization_failure(lab: Lab, since: int) -> None:
    """The kernels wrote no serialization failure to the server's log after byte `since` (a widget message that is
    not JSON: jupyter_client warns there when no cell is running)."""
    text = lab.log.read_bytes()[since:].decode(errors="replace")
    found = [f for f in FAILURES[1:] if f in text]
    assert not found, f"a kernel logged {found[0]!r}:\n{text[text.index(found[0]) - 2000:][:4000]}"


# Every widget output holds its rendered view, each view laid out with some height (none still loading).
RENDERED_JS = f"""() => {{
    const expected = ({WIDGET_OUTPUTS_JS})();
    const views = [...document.querySelectorAll(
        '.jp-OutputArea-output > .jupyter-widgets, .jp-OutputArea-output > .js-plotly-plot')];
    return expected > 0 && views.length === expected && views.every(v => v.getBoundingClientRect().height > 10);
}}"""


def widgets_rendered(page, notebook: str) -> None:
    settled(page, RENDERED_JS)
    expected = page.evaluate(WIDGET_OUTPUTS_JS)
    outputs = page.locator(".jp-OutputArea-output")
    for i in range(outputs.count()):
        text = outputs.nth(i).inner_text()
        bad = [u for u in UNRENDERED if u in text]
        assert not bad, f"{notebook}: output {i} shows {bad[0]!r}: a widget did not render"
    views = page.locator(".jp-OutputArea-output > .jupyter-widgets, .jp-OutputArea-output > .js-plotly-plot")
    assert views.count() == expected, f"{notebook}: {expected} widgets displayed, {views.count()} rendered"
    for i in range(views.count()):
        box = views.nth(i).bounding_box()
        assert box and box["height"] > 10, f"{notebook}: widget {i} rendered empty"


def statics(page):
    """The outputs jupyterlab-plotly drew from plotly JSON: the static copies."""
    return page.locator(".jp-OutputArea-output.jp-RenderedPlotly")


def statics_hidden_while_live(page, notebook: str) -> None:
    """Each live figure has its static copy in the outputs, hidden while the live view renders."""
    settled(page, "() => [...document.querySelectorAll('.jp-OutputArea-output.jp-RenderedPlotly')]"
                  ".every(e => getComputedStyle(e.closest('.jp-OutputArea-child')).visibility === 'hidden')")
    copies = statics(page)
    assert copies.count() > 0, f"{notebook}: no static copy beside the live figures"
    assert all(not c.is_visible() for c in copies.all()), f"{notebook}: a static copy shows beside its live view"


def drawn_points(chart) -> int:
    """Bars, markers and heatmap tiles plotly drew inside one chart (0 for empty axes)."""
    return chart.evaluate("""(el) => el.querySelectorAll(
        '.bars path, .scatterlayer .points path, .heatmaplayer image').length""")


# -- every notebook ------------------------------------------------------------------------------------
def registry(checks: dict):
    """A decorator that files a check in `checks` under its notebook's stem: @registry(checks)(stem)."""
    def by(stem: str):
        def register(check):
            checks[stem] = check
            return check
        return register
    return by


CONTROL_CHECKS = {}
control = registry(CONTROL_CHECKS)


@control("01_decode_step_by_step")
def new_prompt_redraws_the_stepper(page) -> None:
    """Type a prompt and a token count, press decode: the strip shows the new tokens."""
    strip = page.locator(".moebench-token-strip").first
    page.locator(".moebench-prompt textarea").first.fill("for i in range(3):")
    page.locator(".moebench-tokens input").first.fill("5")
    page.locator(".moebench-tokens input").first.press("Tab")
    page.locator(".moebench-decode").first.click()
    page.wait_for_function("(el) => el.querySelectorAll(\"span[title^='step ']\").length === 5",
                           arg=strip.element_handle(), timeout=30_000)
    assert "range" in strip.inner_text()
    # a click on a router cell names its layer and expert under the chart
    page.wait_for_function(KERNEL_IDLE_JS, timeout=30_000)
    cells = page.locator(".moebench-router-view .draglayer .xy .nsewdrag").first
    cells.scroll_into_view_if_needed()
    area = cells.bounding_box()
    page.mouse.move(area["x"] + area["width"] / 2, area["y"] + area["height"] / 2)
    hover = page.locator(".moebench-router-view .hoverlayer .hovertext", has_text="expert").first
    hover.wait_for(state="attached", timeout=10_000)  # plotly finds the hovered cell; the click reports it
    page.mouse.down()
    page.mouse.up()
    readout = page.locator(".moebench-router-view .widget-html", has_text="router probability").first
    readout.wait_for(timeout=30_000)
    assert "layer" in readout.inner_text() and "expert" in readout.inner_text()


@control("02_router_and_experts")
def text_picker_steps_the_prose(page) -> None:
    strip = page.locator(".moebench-token-strip").first
    before = strip.inner_text()
    title = page.locator(".moebench-router-view .gtitle").first
    routed = title.text_content()  # read before the click: the new title can arrive before the next line runs
    page.locator(".moebench-text-picker button", has_text="prose").click()
    page.wait_for_function("([el, t]) => el.innerText !== t && el.innerText.includes('winter')",
                           arg=[strip.element_handle(), before], timeout=30_000)
    # the router figure follows (its updates reach the browser), and the load map reorders by code minus prose
    page.wait_for_function("([el, t]) => el.textContent !== t", arg=[title.element_handle(), routed], timeout=30_000)
    chart = page.locator(".jupyter-widgets .js-plotly-plot", has_text="code minus prose").first
    ticks = chart.evaluate(TICK_BOXES_JS)["x3tick"]
    page.locator(".widget-toggle-buttons button", has_text="by code minus prose").click()
    page.wait_for_function("([el, t]) => [...el.querySelectorAll('.x3tick text')].map(e => e.textContent).join() !== t",
                           arg=[chart.element_handle(), ",".join(t[2] for t in ticks)], timeout=30_000)
    no_overlapping_ticks(chart, "02 load map, reordered")


@control("03_fused_vs_fallback")
def token_picker_compares_another_token(page) -> None:
    picker = page.locator(".moebench-compare-picker select").first
    title = page.locator(".moebench-diff-view .gtitle").first
    summary = page.locator(".moebench-diff-view .widget-html").first
    before = summary.inner_text()
    picker.select_option(index=0)
    page.wait_for_function("([el, t]) => el.innerText !== t", arg=[summary.element_handle(), before], timeout=30_000)
    assert "float32" in title.text_content()
    # the relation between the two error panels is stated from the numbers shown beside it
    assert "per-layer error (left, " in summary.inner_text() and "far above" not in summary.inner_text()


@control("04_live_tokens_per_second")
def benchmark_button_measures(page) -> None:
    table = page.locator(".moebench-bench-table")
    page.locator(".moebench-bench input").nth(1).fill("1")  # one round
    page.locator(".moebench-bench input").nth(1).press("Tab")
    before = table.inner_text()
    page.locator(".moebench-bench-run").click()
    page.wait_for_function("([el, t]) => el.innerText !== t && el.innerText.includes('median')",
                           arg=[table.element_handle(), before], timeout=60_000)
    # a flip while idle marks the chart 8 tokens before its right end: every label whole and apart
    page.wait_for_function(KERNEL_IDLE_JS, timeout=60_000)
    before = last_mark(page, ("fused ON", "fused OFF"))
    status = page.locator(".moebench-live-status").last
    decoded = status.inner_text()
    page.locator(".moebench-fused-toggle").last.click()
    page.wait_for_function(f"(n) => ({MARKS_JS})().some(([x, t]) => x > n && t.startsWith('fused'))", arg=before,
                           timeout=30_000)
    # the flip's tokens decoded (the status comes after the chart's last redraw), then the labels as drawn
    page.wait_for_function("([el, t]) => el.innerText !== t && /^\\d+ tokens decoded/.test(el.innerText)",
                           arg=[status.element_handle(), decoded], timeout=60_000)
    poll(page, lambda: mark_label_problem(page.locator(".js-plotly-plot.moebench-tps-chart").last))


@control("05_interventions")
def ablating_shows_the_effect(page) -> None:
    page.wait_for_function(KERNEL_IDLE_JS, timeout=30_000)
    status = page.locator(".moebench-intervene-status")
    tags = page.locator(".moebench-interventions .jupyter-widget-tag-input, "
                        ".moebench-interventions .jupyter-widgets-tag-input, "
                        ".moebench-interventions [class*='tag'] input").nth(1)
    tags.fill("3")
    tags.press("Enter")
    page.locator(".moebench-intervene-run").click()
    page.wait_for_function("(el) => el.innerText.includes('ablate=(3,)') && el.innerText.includes('mean KL')",
                           arg=status.element_handle(), timeout=60_000)
    assert page.locator(".moebench-token-diff").count() == 1
    # the new result joins the three the cells ran, and is the one shown
    picked = page.locator(".moebench-intervene-result select")
    shown = picked.evaluate("(el) => el.options[el.selectedIndex].text").replace("\xa0", " ")
    assert picked.locator("option").count() == 4 and "4: ablate 3" in shown, shown


@control("06_routing_drift")
def clicking_the_drift_map_shows_that_cell(page) -> None:
    """Hover a cell of the flip map, click it: the readout names that token and shows both routings there and the
    next-token change."""
    page.wait_for_function(KERNEL_IDLE_JS, timeout=30_000)
    readout = page.locator(".moebench-drift-readout").first
    before = readout.inner_text()
    cells = page.locator(".moebench-drift-view .draglayer .xy .nsewdrag").first
    cells.scroll_into_view_if_needed()
    area = cells.bounding_box()
    page.mouse.move(area["x"] + area["width"] * 0.3, area["y"] + area["height"] / 2)
    hover = page.locator(".moebench-drift-view .hoverlayer .hovertext", has_text="layer").first
    hover.wait_for(state="attached", timeout=10_000)
    token = hover.text_content().split()[1]  # "token N ..."
    page.mouse.down()
    page.mouse.up()
    page.wait_for_function("([el, t]) => el.innerText !== t && el.innerText.includes('routing at layer')",
                           arg=[readout.element_handle(), before], timeout=30_000)
    text = readout.inner_text()
    assert text.startswith(f"token {token} ") and "next token" in text and "expert" in text, text[:500]


# -- another model picked: every view follows, or says it shows the last model and offers the run ------------------
# The router heatmap's size as the page holds it: [MoE layers, experts] of its first (probability) trace.
ROUTER_GRID_JS = """(el) => { const z = el.data[0].z; return [z.length, z.length ? z[0].length : 0]; }"""
# Whether some (or every) element matching a selector shows a text (textContent: plotly's titles are SVG text).
SHOWS_JS = """([selector, text, every]) => {
    const found = [...document.querySelectorAll(selector)];
    return found.length > 0 && (every ? found.every(e => e.textContent.includes(text))
                                      : found.some(e => e.textContent.includes(text)));
}"""
HYBRID_TYPES = ("qwen3_next", "qwen3_5_moe")


@dataclass(frozen=True)
class Picked:
    """A tiny family just picked: its folder's name (what the views name), what it has, and whether it is the last
    one picked (whose stale views are measured again)."""

    name: str
    hybrid: bool
    shared_expert: bool
    last: bool
    experts: int


def shows(page, selector: str, text: str, every: bool = False) -> None:
    """Wait until an element matching `selector` (with `every`, each of them) shows `text`."""
    if not settled(page, SHOWS_JS, [selector, text, every]):
        found = [e.text_content()[:300] for e in page.locator(selector).all()]
        pytest.fail(f"{selector} never showed {text!r}: {found}")


def stale_note(page, view: str, picked: Picked, action: str):
    """The line over `view` that says it measured the last model: shown, naming the model picked and the run."""
    note = page.locator(f"{view} .moebench-stale").first
    shows(page, f"{view} .moebench-stale", f"the picker now holds {picked.name}")
    assert note.is_visible() and note.locator(".moebench-stale-rerun").inner_text().strip() == action, \
        note.inner_text()
    return note


def rerun_from_the_note(page, view: str, note, title: str) -> None:
    """Press the note's button: the view measures the model picked, its title says so and the note goes."""
    note.locator(".moebench-stale-rerun").click()
    shows(page, f"{view} .gtitle", title)
    assert settled(page, "(el) => getComputedStyle(el).display === 'none'", note.element_handle()), note.inner_text()


def drawn_grid(chart, experts: int) -> str | None:
    """What is wrong with a drawn layer x expert heatmap: another expert count, or no cell drawn; None if fine."""
    grid = chart.evaluate(ROUTER_GRID_JS)
    return None if grid[1] == experts and drawn_points(chart) > 0 else f"drawn {grid}, {drawn_points(chart)} points"


FOLLOW_CHECKS = {}
follows = registry(FOLLOW_CHECKS)


@follows("01_decode_step_by_step")
def the_stepper_router_and_token_mixing_follow(page, picked: Picked) -> None:
    shows(page, ".moebench-router-view .gtitle", f" on {picked.name}:")
    router = page.locator(".moebench-router-view .js-plotly-plot").first
    poll(page, lambda: drawn_grid(router, picked.experts))
    if picked.hybrid:
        shows(page, ".moebench-mixing-view .moebench-mixer-kind[data-kind='linear_attention']", "linear")
    else:
        shows(page, ".moebench-mixing-view", "no linear-attention layers")


@follows("02_router_and_experts")
def the_load_map_table_and_stepper_follow(page, picked: Picked) -> None:
    shows(page, ".moebench-router-view .gtitle", f" on {picked.name}:")  # the last view both decodes update
    router = page.locator(".moebench-router-view .js-plotly-plot").first
    poll(page, lambda: drawn_grid(router, picked.experts))
    layers = router.evaluate(ROUTER_GRID_JS)[0]
    load_map = page.locator(".jupyter-widgets .js-plotly-plot", has_text="code minus prose").first
    same = "(el, [n, e]) => el.data.every(t => t.z.length === n && t.z[0].length === e)"  # every panel: layers x e
    poll(page, lambda: None if load_map.evaluate(same, [layers, picked.experts]) else
         "the load map is not the new model's")
    table = page.locator(".widget-html", has_text="JS divergence code vs prose").first
    assert table.locator("tbody tr").count() == layers, table.inner_text()


@follows("03_fused_vs_fallback")
def both_comparisons_the_medians_and_the_live_panel_follow(page, picked: Picked) -> None:
    shows(page, ".moebench-diff-view .gtitle", f"fused vs fallback on {picked.name},", every=True)
    shows(page, ".moebench-live-text", f"on {picked.name}")
    shows(page, ".moebench-median-table", f"on {picked.name}")


@follows("04_live_tokens_per_second")
def the_live_panel_follows_and_the_benchmark_says_it_measured_the_last_model(page, picked: Picked) -> None:
    shows(page, ".moebench-live-text", f"on {picked.name}")
    note = stale_note(page, ".moebench-bench", picked, "run benchmark")
    if picked.last:
        page.locator(".moebench-bench input").nth(1).fill("1")  # one round
        page.locator(".moebench-bench input").nth(1).press("Tab")
        rerun_from_the_note(page, ".moebench-bench", note, f"on {picked.name}")


@follows("05_interventions")
def the_panel_starts_over_on_the_new_model(page, picked: Picked) -> None:
    shows(page, ".moebench-interventions .gtitle", f" on {picked.name}:")  # the baseline's routing
    before = page.locator(".moebench-interventions .js-plotly-plot", has_text="baseline:").first
    poll(page, lambda: drawn_grid(before, picked.experts))
    shared = page.locator(".moebench-interventions .widget-checkbox", has_text="shared expert").first
    words = "shared expert on" if picked.shared_expert else "no shared expert in this model"
    assert words in shared.inner_text() and shared.locator("input").is_disabled() != picked.shared_expert, \
        shared.inner_text()
    assert page.locator(".moebench-intervene-result option").count() == 0  # the last model's results: gone


@follows("06_routing_drift")
def the_drift_map_says_it_is_the_last_models_and_offers_compare(page, picked: Picked) -> None:
    note = stale_note(page, ".moebench-drift-view", picked, "compare")
    if picked.last:
        rerun_from_the_note(page, ".moebench-drift-view", note, f"against {picked.name}:")


def pick(page, folder: Path) -> str:
    """Pick `folder` in the notebook's model picker as a person does; returns what the picker says of it, once
    opened (not 'opening ...')."""
    page.locator(".moebench-model-picker select").first.select_option(label=str(folder))
    info = page.locator(".moebench-model-picker + .widget-html").first
    opened = "([el, name]) => el.innerText.includes(name) && el.innerText.includes('experts')"
    assert settled(page, opened, [info.element_handle(), folder.name]), info.inner_text()
    return info.inner_text()


@pytest.mark.parametrize("notebook", [nb.name for nb in NOTEBOOKS])
def test_notebook_runs_renders_its_controls_act_and_it_follows_the_model_picker(lab, browser, families, notebook):
    """Run All on the shipped model, use one control, then pick each tiny family in the picker (Qwen3-MoE, OLMoE,
    gpt-oss, Qwen3.5, Qwen3-Next, GLM-4.x, DeepSeek-V3): every view follows, or says it shows the last model and
    offers the run (pressed on the last family); after each, no cell or widget failed, no message failed to
    serialize, every widget is drawn; no JavaScript error."""
    stem = notebook.removesuffix(".ipynb")
    errors: list[str] = []
    since = lab.log.stat().st_size
    page = open_notebook(browser, lab, notebook, errors)
    try:
        run_all_cells(page)
        no_error_outputs(page, notebook)
        widgets_rendered(page, notebook)
        statics_hidden_while_live(page, notebook)
        shot(page, f"{stem}-run-all")
        CONTROL_CHECKS[stem](page)
        page.wait_for_function(KERNEL_IDLE_JS, timeout=60_000)
        no_error_outputs(page, notebook)
        shot(page, f"{stem}-after-control")
        for i, (family, folder) in enumerate(families.items()):
            config = get_preset(FAMILIES[family]).config
            args = model_args(config)
            picked = Picked(folder.name, config["model_type"] in HYBRID_TYPES,
                            bool(args.shared_expert_intermediate_size), i == len(families) - 1, args.num_experts)
            info = pick(page, folder)
            if picked.hybrid:
                assert "3 linear attention + 1 full attention (full attention: layer 3), 8 experts" in info, info
            FOLLOW_CHECKS[stem](page, picked)
            no_error_outputs(page, f"{notebook} on {family}")
            widgets_rendered(page, f"{notebook} on {family}")
            statics_hidden_while_live(page, f"{notebook} on {family}")
            no_serialization_failure(lab, since)
            assert not errors, f"{notebook} on {family}: JavaScript errors:\n" + "\n".join(errors)
        shot(page, f"{stem}-{picked.name}")
    finally:
        page.close()


def test_scrubbing_the_stepper_moves_it_while_the_kernel_is_busy(lab, browser):
    """With the kernel's shell busy (waiting for a signal, until the test interrupts it), clicking a token still moves
    the slider and the highlight (the stepper's play widget, slider and strip are linked in the browser); once the
    kernel is free, the Python views (the router) show the step chosen in the browser."""
    errors: list[str] = []
    page = open_notebook(browser, lab, fresh_copy(lab, "01_decode_step_by_step.ipynb", "scrub-01.ipynb"), errors)
    try:
        run_all_cells(page)
        no_error_outputs(page, "01")
        stepper = page.locator(".moebench-stepper").first
        router_title = page.locator(".js-plotly-plot .gtitle", has_text="routing of token").first
        router_title.wait_for(timeout=30_000)
        title_before = router_title.text_content()
        spans = stepper.locator(".moebench-token-strip span[title^='step ']")
        target = spans.count() - 1
        assert target > 0, "the token strip shows fewer than two steps"
        execute(page, "import signal; signal.pause()", "sleep", wait=False)  # busy until the interrupt below
        spans.nth(target).click()
        readout = stepper.locator(".widget-readout").first
        page.wait_for_function("([el, want]) => el.innerText.trim() === want",
                               arg=[readout.element_handle(), str(target)], timeout=30_000)
        assert "outline" in (spans.nth(target).get_attribute("style") or "")
        sleeping = page.evaluate("() => !window.moebenchRuns.sleep.done")
        assert sleeping, "the kernel finished its wait before the scrub was checked: the check proves nothing"
        shot(page, "01-scrubbed-while-busy")
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.interrupt()")
        page.wait_for_function("([el, text]) => el.textContent !== text",
                               arg=[router_title.element_handle(), title_before], timeout=30_000)
        page.wait_for_function(KERNEL_IDLE_JS, timeout=30_000)
        assert not errors, "JavaScript errors:\n" + "\n".join(errors)
    finally:
        page.close()


# -- figures while plotly's bundle loads slowly (issue 40) --
# The page stays busy for 2.5 s whenever plotly's widget bundle (a JavaScript module over 1 MB, imported from a
# blob URL) starts loading, as a small machine shared with the kernel keeps it: the module cannot be evaluated
# within the 2 s anywidget gives a model from its creation. createObjectURL is passed through unchanged.
BUSY_WHILE_PLOTLY_LOADS_JS = """(() => {
    const create = URL.createObjectURL;
    URL.createObjectURL = function (blob) {
        if (blob instanceof Blob && blob.type === 'text/javascript' && blob.size > 1e6) {
            const end = performance.now() + 2500;
            while (performance.now() < end);
        }
        return create.call(URL, blob);
    };
})();"""
SLOW_FIGURE_CELL = """from moebench.widgets.figure import LiveFigure

figure = LiveFigure(layout={"title": {"text": "created"}})
display(figure)
figure.add_scatter(y=[1, 3, 2])  # sent while the browser is still loading plotly
figure.layout.title.text = "updated at once"
"""
TITLES_JS = "() => [...document.querySelectorAll('.js-plotly-plot .gtitle')].map(e => e.textContent)"


def test_a_figure_follows_the_kernel_when_plotly_loads_slowly(lab, browser):
    """A figure's updates reach the browser however long plotly's 5 MB bundle takes to load: those sent while it
    loads (the page kept busy past anywidget's 2 s) and those sent after. Before moebench loaded the bundle
    outside anywidget's initialisation, such a figure failed to initialise ("[anywidget] Failed to initialize
    model.") and dropped every later update: the chart stayed as first drawn while the kernel moved on."""
    cells = [{"cell_type": "code", "execution_count": None, "id": "0", "metadata": {}, "outputs": [],
              "source": SLOW_FIGURE_CELL}]
    name = "slow-plotly.ipynb"
    (lab.folder / name).write_text(json.dumps({"cells": cells, "metadata": {"kernelspec": {
        "display_name": "Python 3", "language": "python", "name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}))
    errors: list[str] = []
    page = open_notebook(browser, lab, name, errors)
    try:
        page.add_init_script(BUSY_WHILE_PLOTLY_LOADS_JS)
        page.reload(wait_until="domcontentloaded")  # the script runs from the page's start
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                               " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=60_000)
        run_all_cells(page)
        settled(page, f"() => ({TITLES_JS})().join() === 'updated at once'", timeout_ms=30_000)  # busy spell over
        shot(page, "figure-while-plotly-loads-slowly")
        assert page.evaluate(TITLES_JS) == ["updated at once"], (page.evaluate(TITLES_JS), errors)
        execute(page, 'figure.layout.title.text = "later"')
        page.wait_for_function(f"() => ({TITLES_JS})().join() === 'later'", timeout=30_000)
        assert drawn_points(page.locator(".js-plotly-plot").first) == 3
        assert not errors, "JavaScript errors:\n" + "\n".join(errors)
    finally:
        page.close()


# -- 04: the crash path, reload, reopen ----------------------------------------------------------------
LIVE = "04_live_tokens_per_second.ipynb"
SWITCHES_JS = "import json; print(json.dumps([[r.fused_switch, bool(r.layers)] for r in {}]))"


def switches(page, records: str) -> list[list[bool]]:
    return json.loads(execute(page, SWITCHES_JS.format(records), name="switches").strip().splitlines()[-1])


def click_toggle(page) -> None:
    page.locator(".moebench-fused-toggle").last.click()


def label_and_button_agree(page) -> None:
    """After a run, the button's state and the label's 'switch on/off' name the same thing."""
    page.wait_for_function(KERNEL_IDLE_JS, timeout=60_000)
    button = page.locator(".moebench-fused-toggle").last.inner_text()
    label = page.locator(".moebench-backend-label").last.inner_text()
    on = "ON" in button
    assert f"switch {'on' if on else 'off'};" in label and "applies from the next token" not in label, (button, label)


# The chart's marks as plotly holds them in the page: [position, label] for every annotation.
MARKS_JS = """() => ((document.querySelector('.js-plotly-plot.moebench-tps-chart') || {}).layout || {annotations: []})
    .annotations.map(a => [a.x, a.text])"""


def last_mark(page, labels: tuple[str, ...]) -> float:
    return max((x for x, text in page.evaluate(MARKS_JS) if any(t in text for t in labels)), default=-1)


def click_and_see_the_mark(page, what: str) -> None:
    """Click the toggle or the recording box; the chart must show a new mark (drawn between two tokens)."""
    labels = ("fused ON", "fused OFF") if what == "toggle" else ("recording ON", "recording OFF")
    before = last_mark(page, labels)
    target = page.locator(".moebench-fused-toggle" if what == "toggle" else ".moebench-record-toggle input").last
    target.click()
    page.wait_for_function(f"([n, a, b]) => ({MARKS_JS})().some(([x, t]) => x > n && (t.includes(a) || t.includes(b)))",
                           arg=[before, *labels], timeout=30_000)


def stop_and_check(page, run: str, attempt: int) -> None:
    """Press stop; the run's records show the flip and the untick between two of its tokens."""
    page.locator(".moebench-live-stop").last.click()
    finish(page, run)
    steps = switches(page, "records")
    changes = transitions(steps)
    assert 1 <= len(changes) <= 2 and len(steps) < 3000, (run, attempt, changes, len(steps))
    assert steps[0][0] != steps[-1][0] and steps[0][1] and not steps[-1][1], (run, attempt, changes)
    label_and_button_agree(page)


def transitions(steps: list) -> list:
    return [i for i in range(1, len(steps)) if steps[i] != steps[i - 1]]


def test_04_toggle_and_recording_act_between_tokens_in_every_state(lab, browser):
    """Issue 22's crash path, 3 times over: flip while idle, flip and untick recording during a live decode
    (a task running while the kernel is idle) and during an `await`, flip during a decode a cell runs. Every
    decode stays on the kernel's main thread (clicks arrive on a subshell thread); no error anywhere."""
    errors: list[str] = []
    page = open_notebook(browser, lab, LIVE, errors)
    try:
        run_all_cells(page)
        no_error_outputs(page, LIVE)
        widgets_rendered(page, LIVE)
        execute(page, "LONG = 3000  # stopped by the stop button once the clicks are seen", name="long")
        label = page.locator(".moebench-backend-label").last
        for attempt in range(3):
            # idle: the flip decodes a few tokens by itself, on the main thread
            before = int(execute(page, "print(live.decoded)", name="count"))
            click_toggle(page)
            page.wait_for_function("(el) => !el.innerText.includes('applies from the next token')",
                                   arg=label.element_handle(), timeout=30_000)
            page.wait_for_function(KERNEL_IDLE_JS, timeout=30_000)
            assert int(execute(page, "print(live.decoded)", name="count")) == before + 8, attempt
            label_and_button_agree(page)
            # a live decode, the kernel idle between tokens: flip, then untick recording, while it runs
            execute(page, "live.record_box.value = True\ntask = live.start(LONG)", name="start")
            click_and_see_the_mark(page, "toggle")
            click_and_see_the_mark(page, "recording")
            execute(page, "records = await task", name="bg", wait=False)
            stop_and_check(page, "bg", attempt)
            # during an `await`: the same, while the cell waits for the task
            execute(page, "live.record_box.value = True", name="set")
            execute(page, "records = await live.start(LONG)", name="await", wait=False)
            click_and_see_the_mark(page, "toggle")
            click_and_see_the_mark(page, "recording")
            stop_and_check(page, "await", attempt)
            # during a decode a cell runs: the click reaches the kernel on a subshell thread, which sets the
            # switch; the cell's next token reads it
            execute(page, "live.record_box.value = True\nrecords = live.run(LONG)", name="sync", wait=False)
            click_and_see_the_mark(page, "toggle")
            click_and_see_the_mark(page, "recording")
            stop_and_check(page, "sync", attempt)
        no_error_outputs(page, LIVE)
        shot(page, "04-after-flips")
        assert not errors, "JavaScript errors:\n" + "\n".join(errors)
    finally:
        page.close()


LIVE_CHARTS = ".jp-OutputArea-output > .jupyter-widgets .js-plotly-plot"
# Per live chart in the page, the length of each trace's x: what the page holds of the figures' data.
PAGE_TRACES_JS = (f"() => [...document.querySelectorAll('{LIVE_CHARTS}')]"
                  ".map(el => el.data.map(t => t.x ? t.x.length : 0))")


def drawn_as_the_kernel_has_them(page, figures: str) -> list[int]:
    """Wait until the page's live charts hold the data the kernel's `figures` (Python naming them, in page order)
    hold, every chart drawn; returns each chart's drawn points."""
    code = f"import json; print(json.dumps([[len(t.x or ()) for t in f.data] for f in ({figures},)]))"
    kernel = json.loads(execute(page, code, name="traces").strip().splitlines()[-1])
    poll(page, lambda: None if page.evaluate(PAGE_TRACES_JS) == kernel else f"{page.evaluate(PAGE_TRACES_JS)} "
                                                                             f"!= the kernel's {kernel}")
    charts = page.locator(LIVE_CHARTS)
    poll(page, lambda: None if all(drawn_points(c) > 0 for c in charts.all()) else "a chart drawn empty")
    return [drawn_points(c) for c in charts.all()]


def test_reload_with_the_kernel_running_redraws_every_chart(lab, browser):
    """Reloading the tab asks the kernel for each widget's state: the charts come back as they were."""
    errors: list[str] = []
    page = open_notebook(browser, lab, fresh_copy(lab, LIVE, "reload-04.ipynb"), errors)
    try:
        run_all_cells(page)
        before = drawn_as_the_kernel_has_them(page, "chart.figure, bench.figure")
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")  # the outputs the tab reloads
        page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000)
        page.reload(wait_until="domcontentloaded")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=60_000)
        charts = page.locator(LIVE_CHARTS)
        poll(page, lambda: None if [drawn_points(c) for c in charts.all()] == before else
             f"drawn {[drawn_points(c) for c in charts.all()]} after the reload, {before} before")
        statics_hidden_while_live(page, LIVE)
        shot(page, "04-after-reload")
        assert not errors, "JavaScript errors:\n" + "\n".join(errors)
    finally:
        page.close()


@pytest.mark.parametrize("notebook", ["01_decode_step_by_step.ipynb", LIVE])
def test_reopened_after_the_kernel_stopped_the_static_pictures_show(lab, browser, notebook):
    """Save, shut the kernel down, open the notebook again: each chart's last picture is in its outputs, and no
    widget output shows JupyterLab's "Error displaying widget: model not found" (the views are gone with the kernel;
    their static pictures stand in for them)."""
    stem = notebook.removesuffix(".ipynb")
    notebook = fresh_copy(lab, notebook, f"reopen-{notebook}")
    errors: list[str] = []
    page = open_notebook(browser, lab, notebook, errors)
    try:
        run_all_cells(page)
        widgets_rendered(page, notebook)
        live = page.locator(LIVE_CHARTS).count()
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000)
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")  # awaits it
    finally:
        page.close()
    saved = json.loads((lab.folder / notebook).read_text())
    kept = [o for c in saved["cells"] for o in c.get("outputs", []) if PLOTLY_MIME in o.get("data", {})]
    assert len(kept) >= live > 0, (len(kept), live)
    page = open_notebook(browser, lab, notebook, errors)
    try:
        page.wait_for_function(f"() => document.querySelectorAll('.jp-RenderedPlotly').length >= {live}",
                               timeout=60_000)
        copies = statics(page)
        for copy in copies.all():
            copy.scroll_into_view_if_needed()
            # jupyterlab-plotly draws the figure, or the PNG it stored in the output the last time it drew it
            page.wait_for_function("(el) => el.querySelector('.main-svg') || (el.querySelector('img.plot-img')"
                                   " && el.querySelector('img.plot-img').naturalHeight > 100)",
                                   arg=copy.element_handle(), timeout=30_000)
            assert copy.is_visible() and copy.bounding_box()["height"] > 100
        # every widget output resolved (its view, or JupyterLab's "model not found"): none of the errors shows
        loading = "() => ![...document.querySelectorAll('.jp-OutputArea-output')].some(e => " \
                  "e.textContent.includes('Loading widget'))"
        assert settled(page, loading), "a widget output still says 'Loading widget...'"
        shown = [e.inner_text() for e in page.locator(".jp-OutputArea-output", has_text="Error displaying").all()
                 if e.is_visible()]
        assert not shown, f"{len(shown)} widget outputs show {shown[0]!r}"
        shot(page, f"{stem}-reopened")
    finally:
        page.close()


# -- heatmaps at scale (issue 40) --
HEATMAP_CELLS = ['''import tempfile

import moebench
from moebench.inspect.interventions import intervene
from moebench.inspect.record import Stepper
from moebench.tools.writer import qwen2_moe_config, write_random_checkpoint
from moebench.widgets import ExpertLoadMap, RouterView

N = {n}
config = qwen2_moe_config(num_experts=N, num_experts_per_tok=8, num_hidden_layers=3, hidden_size=64,
                          moe_intermediate_size=32, intermediate_size=64, shared_expert_intermediate_size=64)
model, _ = moebench.load(write_random_checkpoint(tempfile.mkdtemp() + "/model", config, seed=3))
with intervene(model, moebench.Intervention(force_experts=(0, 1, 2, 3, 4, 5, 6, N - 1))):  # boxes on both edges
    trace = Stepper(model, None, [1, 2, 3, 4], record=True).run(2)
router = RouterView()
router.scale_to(trace.steps)
router.show(trace.steps[-1])
router''', '''import pandas as pd


def load(favourite):
    """Every layer sends half its selections to `favourite`, the rest evenly to the others."""
    shares = [0.5 if e == favourite else 0.5 / (N - 1) for e in range(N)]
    return pd.DataFrame([{{"layer": layer, "expert": e, "count": 0, "fraction": shares[e]}}
                         for layer in range(3) for e in range(N)])


load_map = ExpertLoadMap({{"code": load(N - 1), "prose": load(0)}})  # code minus prose: + on expert N-1, - on 0
load_map''']
# Per x axis of a chart ('xtick', 'x2tick', ...): its tick labels' boxes [left, right, text], left to right.
TICK_BOXES_JS = """(el) => {
    const axes = {};
    for (const text of el.querySelectorAll('.xaxislayer-above text')) {
        const r = text.getBoundingClientRect();
        if (!text.textContent || r.width === 0) continue;
        (axes[text.parentNode.getAttribute('class')] ||= []).push([r.left, r.right, text.textContent]);
    }
    for (const boxes of Object.values(axes)) boxes.sort((a, b) => a[0] - b[0]);
    return axes;
}"""
# The router's plot area and its top-k boxes, [left, right] each.
BOXES_JS = """(el) => {
    const area = el.querySelector('.draglayer .xy .nsewdrag').getBoundingClientRect();
    const boxes = [...el.querySelectorAll('.subplot.xy .scatterlayer .trace:first-child .points path')]
        .map(p => p.getBoundingClientRect());
    return {area: [area.left, area.right], boxes: boxes.map(b => [b.left, b.right])};
}"""
# The colour of one cell of the third panel's heatmap (row, column of rows x columns), read from its image.
CELL_RGB_JS = """async ([el, row, col, rows, cols]) => {
    const image = el.querySelector('.subplot.x3y3 .heatmaplayer image');
    const picture = new Image();
    picture.src = image.getAttribute('href') || image.getAttribute('xlink:href');
    await picture.decode();
    const canvas = document.createElement('canvas');
    canvas.width = picture.naturalWidth;
    canvas.height = picture.naturalHeight;
    const context = canvas.getContext('2d');
    context.drawImage(picture, 0, 0);
    const x = Math.floor((col + 0.5) / cols * canvas.width), y = Math.floor((row + 0.5) / rows * canvas.height);
    return [...context.getImageData(x, y, 1, 1).data.slice(0, 3)];
}"""
# Each colour bar: its title, its tick labels from top to bottom, and the colours at its top and bottom edges
# (its fill is an SVG linear gradient: the stop nearest each edge along the gradient's direction).
COLORBARS_JS = """(el) => [...el.querySelectorAll('.colorbar')].map(bar => {
    const fill = bar.querySelector('.cbfill');
    const id = (fill.style.fill || fill.getAttribute('fill')).match(/#([^"')]+)/)[1];
    const gradient = document.getElementById(id);
    const at = (name, missing) => parseFloat(gradient.getAttribute(name) ?? missing) /
        (String(gradient.getAttribute(name) ?? '').endsWith('%') ? 100 : 1);
    const [x1, y1, x2, y2] = [at('x1', 0), at('y1', 0), at('x2', 1), at('y2', 0)];
    const along = (x, y) => ((x - x1) * (x2 - x1) + (y - y1) * (y2 - y1)) / ((x2 - x1) ** 2 + (y2 - y1) ** 2);
    const stops = [...gradient.querySelectorAll('stop')].map(s => [parseFloat(s.getAttribute('offset')) /
        (s.getAttribute('offset').endsWith('%') ? 100 : 1), s.getAttribute('stop-color') || s.style.stopColor]);
    const colour = (t) => stops.reduce((best, s) => Math.abs(s[0] - t) < Math.abs(best[0] - t) ? s : best)[1];
    return {
        title: (bar.querySelector('.cbtitle') || {textContent: ''}).textContent,
        ticks: [...bar.querySelectorAll('.cbaxis text')].map(t => [t.getBoundingClientRect().top, t.textContent])
            .sort((a, b) => a[0] - b[0]).map(t => t[1]),
        top: colour(along(0.5, 0)), bottom: colour(along(0.5, 1)),
    };
})"""


def rgb(colour: str) -> tuple[int, ...]:
    """'rgb(103, 0, 31)' or '#67001f' as (103, 0, 31)."""
    if colour.startswith("#"):
        return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return tuple(int(float(v)) for v in colour[colour.index("(") + 1:colour.index(")")].split(",")[:3])


def heatmap_notebook(lab, n: int) -> str:
    """A notebook that draws the router heatmap and the load maps of an `n`-expert model."""
    cells = [{"cell_type": "code", "execution_count": None, "id": str(i), "metadata": {}, "outputs": [],
              "source": source.format(n=n)} for i, source in enumerate(HEATMAP_CELLS)]
    name = f"heatmap-{n}.ipynb"
    (lab.folder / name).write_text(json.dumps({"cells": cells, "metadata": {"kernelspec": {
        "display_name": "Python 3", "language": "python", "name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}))
    return name


def no_overlapping_ticks(chart, what: str) -> int:
    """Every x axis of `chart` has labels that do not touch each other; returns how many labels the widest holds."""
    axes = chart.evaluate(TICK_BOXES_JS)
    assert axes, f"{what}: no x tick labels drawn"
    for axis, boxes in axes.items():
        for (_, right, text), (left, _, after) in zip(boxes, boxes[1:], strict=False):
            assert left >= right, f"{what} {axis}: labels {text!r} and {after!r} overlap ({right:.1f} > {left:.1f})"
    return max(len(b) for b in axes.values())


@pytest.mark.parametrize("n", [128, 512])
def test_heatmap_at_many_experts_has_readable_ticks_unclipped_boxes_and_a_true_colour_key(lab, browser, n):
    """An n-expert model's router heatmap and code-minus-prose map, measured in the rendered SVG: no two x tick
    labels overlap, the top-k boxes on experts 0 and n-1 lie inside the plot, and the expert code uses more
    (known positive) is drawn in the colour the colour bar's "code uses it more" end has."""
    errors: list[str] = []
    page = open_notebook(browser, lab, heatmap_notebook(lab, n), errors)
    try:
        run_all_cells(page)
        no_error_outputs(page, f"heatmap-{n}")
        widgets_rendered(page, f"heatmap-{n}")
        router, load_map = page.locator(LIVE_CHARTS).all()
        poll(page, lambda: drawn_grid(router, n) or drawn_grid(load_map, n))  # as the cells drew them
        shown = [no_overlapping_ticks(router, "router"), no_overlapping_ticks(load_map, "load map")]
        assert all(8 <= s < n for s in shown), f"labels thinned to too few or none: {shown}"
        marks = router.evaluate(BOXES_JS)
        (left, right), boxes = marks["area"], marks["boxes"]
        assert len(boxes) == 8 * 3, marks  # 8 forced experts in each of 3 layers
        assert all(left - 0.5 <= a and b <= right + 0.5 for a, b in boxes), f"a box is clipped: {marks}"
        key = {bar["title"]: bar for bar in load_map.evaluate(COLORBARS_JS)}["code minus prose"]
        assert key["ticks"][0].endswith("code uses it more") and key["ticks"][-1].endswith("prose uses it more"), key
        top, bottom = rgb(key["top"]), rgb(key["bottom"])  # the colours those two labels stand beside
        cell = page.evaluate(CELL_RGB_JS, [load_map.element_handle(), 0, n - 1, 3, n])  # code's: known positive
        assert max(abs(a - b) for a, b in zip(cell, top, strict=True)) <= 3, f"expert {n - 1}: {cell}, key: {key}"
        assert cell[0] > 2 * max(cell[1:]), f"expert {n - 1}, which code uses more, is drawn {cell}, not red"
        cell = page.evaluate(CELL_RGB_JS, [load_map.element_handle(), 0, 0, 3, n])  # prose's: known negative
        assert max(abs(a - b) for a, b in zip(cell, bottom, strict=True)) <= 3, f"expert 0: {cell}, key: {key}"
        shot(page, f"heatmap-{n}")
        assert not errors, "JavaScript errors:\n" + "\n".join(errors)
    finally:
        page.close()


# -- notebooks 03-05 (issue 40) --
# Each annotation's box and the figure's, [left, top, right, bottom], in the page.
ANNOTATION_BOXES_JS = """(el) => {
    const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    return {figure: box(el.querySelector('.main-svg')),
            labels: [...el.querySelectorAll('.annotation')].map(a => [a.textContent, box(a)])};
}"""


def mark_label_problem(chart) -> str | None:
    """What is wrong with the tok/s chart's mark labels as drawn (one outside the figure, two overlapping), or None."""
    drawn = chart.evaluate(ANNOTATION_BOXES_JS)
    (fl, ft, fr, fb), labels = drawn["figure"], drawn["labels"]
    if not labels:
        return "no mark label drawn"
    for i, (text, (left, top, right, bottom)) in enumerate(labels):
        if not (fl - 0.5 <= left and right <= fr + 0.5 and ft - 0.5 <= top and bottom <= fb + 0.5):
            return f"label {text!r} is clipped: {drawn}"
        for other, (l2, t2, r2, b2) in labels[i + 1:]:
            if not (right <= l2 + 0.5 or r2 <= left + 0.5 or bottom <= t2 + 0.5 or b2 <= top + 0.5):
                return f"labels {text!r} and {other!r} overlap: {drawn}"
    return None


def test_05_after_run_all_shows_what_its_cells_did_and_saving_leaves_git_clean(lab, browser, tmp_path):
    """Run All in JupyterLab: the effect chart and both routing heatmaps are drawn with points, the panel lists
    the three interventions its cells ran (none says 'no intervened decode yet'), the export bar is there, no
    JavaScript error; then JupyterLab's save of the run notebook, committed through the checkout's output
    filter, leaves `git diff` empty."""
    from gitfilter import assert_git_clean_after_run, scratch_repo

    notebook = "05_interventions.ipynb"
    repo_copy = scratch_repo(tmp_path / "repo", notebook)
    name = fresh_copy(lab, notebook, "saved-05.ipynb")
    errors: list[str] = []
    page = open_notebook(browser, lab, name, errors)
    try:
        run_all_cells(page)
        no_error_outputs(page, name)
        widgets_rendered(page, name)
        panel = page.locator(".moebench-interventions")
        charts = panel.locator(".js-plotly-plot")
        # the browser may still be drawing what the kernel sent: wait for the last result, drawn in all three charts
        results = page.locator(".moebench-intervene-result option")
        poll(page, lambda: None if "no intervened decode yet" not in panel.inner_text() and results.count() == 3
             and charts.count() == 3 and all(drawn_points(c) > 0 for c in charts.all())
             else (results.count(), [drawn_points(c) for c in charts.all()]))
        options = [o.replace("\xa0", " ") for o in page.locator(".moebench-intervene-result option").all_inner_texts()]
        assert [o.split(":")[0] for o in options] == ["1", "2", "3"] and "shared gate x0.25" in options[-1], options
        assert page.locator(".moebench-token-diff").count() == 1 and page.locator(".moebench-export").count() == 1
        placeholder = panel.locator("input[placeholder*='Enter']")
        assert placeholder.count() == 2 and all(b.bounding_box()["width"] > 100 for b in placeholder.all())
        shot(page, "05-run-all-results")
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=30_000)
        assert not errors, "JavaScript errors:\n" + "\n".join(errors)
    finally:
        page.close()
    shutil.copy(lab.folder / name, repo_copy)
    assert_git_clean_after_run(repo_copy.parents[1], notebook)
