"""Every notebook as an attendee sees it: JupyterLab in headless Chromium, Run All, then look.

This is how the test session executes the notebooks (``tests/conftest.py``: ``notebook_records``),
each once, in order, on the offline profile, in one folder: JupyterLab saves each executed notebook
where it ran, and tests/workshop/test_notebooks.py checks both what it computed (its records) and
what JupyterLab showed (:func:`run_in_lab`'s findings): images that load, no red stderr or
tracebacks, progress bars drawn as widgets rather than text, no stray ``Out[..]:``, the accelerate
form of notebook 03 writing its files when clicked, the upload form of 02 keeping only pictures. A
full-page screenshot of each notebook goes to ``build/lab/<notebook>.png`` with a JSON report
(findings, timings, kernel-status samples) beside it.

How it drives JupyterLab: the server runs with ``--LabApp.expose_app_in_browser=True``, so
``window.jupyterapp`` is the application; Run All is its ``notebook:run-all-cells`` command, and a
notebook is done when no code cell is queued or running (``model.executionState``, the ``[*]``
prompt) and the kernel reads idle, for a few polls in a row, within a hard limit per notebook.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import importlib.util
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from helpers.workshop import jupyter, notebooks

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "build" / "lab"

SERVER_START_S = 90  # until /api/status answers
PAGE_READY_S = 120  # the app started and the notebook panel open
KERNEL_READY_S = 180  # a kernel started and idle (about 4 s when the machine is quiet)
NOTEBOOK_LIMIT_S = 1200  # Run All of one notebook (the longest, 07, takes about 6 min in CI)
STALL_S = 120  # cells still queued while the kernel reads idle this long: Run All has stopped, not slowed
REOPEN_S = 60  # a saved notebook reopened: its widgets drawn again from the saved state
FORM_WRITE_S = 60  # notebook 03's button click to its files on disk
POLL_S = 2.0
IDLE_POLLS = 3  # consecutive polls with nothing queued and the kernel idle: the notebook is done
MAX_BARS_PER_CELL = 3  # more progress bars than this in one cell is clutter, not progress
IDLE_WHILE_RUNNING_S = 10  # longer than this reading "Idle" while a cell runs is a wrong status, not a gap
WINDOW = (1400, 1000)

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", f"--window-size={WINDOW[0]},{WINDOW[1]}",
)  # fmt: skip

# Settings an attendee's JupyterLab would not differ in, except: every cell attached to the DOM
# ("none" windowing), so the checks and the screenshot see the whole notebook; each cell's run times
# kept in the saved notebook (the report's seconds per cell: where a notebook's time goes); no news toast.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        "recordTiming": True,
    },
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}


def missing_tools() -> str:
    """Why this test cannot run here ("" if it can): each missing program or package, and how to get it."""
    missing = []
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium is not installed (`make setup` installs requirements.txt)")
    if importlib.util.find_spec("jupyterlab") is None:
        missing.append(f"jupyterlab is not installed in {sys.prefix} (`make setup`)")
    if shutil.which("chromium") is None:
        missing.append(
            "chromium is not installed (`make system-packages` installs Debian's chromium as root)"
        )
    if shutil.which("chromedriver") is None:
        missing.append(
            "chromedriver is not installed (`make system-packages` installs Debian's chromium-driver as root)"
        )
    return "; ".join(missing)


MISSING = missing_tools()


# --- the JavaScript run in the page ------------------------------------------------------------

# arguments[0]: the notebook's path relative to the server root. Every script finds its panel.
JS_PANEL = """
const app = window.jupyterapp;
if (!app || !app.shell) return null;
let panel = null;
for (const w of app.shell.widgets('main')) {
  if (w.context && w.context.path === arguments[0] && w.content && w.content.widgets) panel = w;
}
"""

JS_READY = (
    JS_PANEL
    + """
if (!app) return 'window.jupyterapp is not exposed';
if (!panel) return 'no notebook panel for ' + arguments[0];
const ctx = panel.sessionContext;
const kernel = ctx.session && ctx.session.kernel;
if (!kernel) return 'no kernel yet';
if (!ctx.isReady || kernel.connectionStatus !== 'connected') return 'kernel ' + kernel.connectionStatus;
return kernel.status === 'idle' ? 'ready' : 'kernel ' + kernel.status;
"""
)

JS_RUN_ALL = (
    JS_PANEL
    + """
if (!app.commands.hasCommand('notebook:run-all-cells')) return 'no notebook:run-all-cells command';
app.shell.activateById(panel.id);
window.__runAll = 'running';
app.commands.execute('notebook:run-all-cells').then(
  () => { window.__runAll = 'resolved'; }, e => { window.__runAll = 'rejected: ' + e; });
return 'started';
"""
)

JS_STATE = (
    JS_PANEL
    + """
if (!panel) return null;
const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
const code = panel.content.widgets.filter(c => c.model.type === 'code');
const bar = document.querySelector('#jp-main-statusbar');
return {
  kernel: kernel ? kernel.status : 'none',
  statusbar: bar ? bar.innerText.replace(/\\s+/g, ' ').trim() : '',
  runAll: window.__runAll || '',
  code: code.length,
  pending: code.map((c, i) => [i, c.model.executionState]).filter(p => p[1] === 'running').map(p => p[0]),
  starred: code.filter(c => (c.node.querySelector('.jp-InputPrompt') || {}).innerText === '[*]:').length,
  counts: code.map(c => c.model.executionCount),
};
"""
)

JS_INSPECT = (
    JS_PANEL
    + """
if (!panel) return null;
const text = el => (el ? el.innerText : '').slice(0, 400);
return panel.content.widgets.map((cell, index) => {
  const node = cell.node;
  const model = cell.model.type === 'code' ? cell.model.outputs : null;
  const area = node.querySelector('.jp-Cell-outputArea');
  // The cell's own outputs, in the model's order; output widgets nest further output areas inside.
  const children = area ? [...area.querySelectorAll(':scope > .jp-OutputArea-child')] : [];
  const outputs = children.map((child, i) => {
    const out = child.querySelector('.jp-OutputArea-output');
    const json = model && i < model.length ? model.get(i).toJSON() : {};
    child.dataset.workshopOutputType = json.output_type || '';
    return {
      type: json.output_type || null,
      ename: json.ename || null,
      evalue: json.evalue || null,
      mime: out ? out.getAttribute('data-mime-type') : null,
      widgetView: !!(json.data && json.data['application/vnd.jupyter.widget-view+json']),
      widgetDrawn: !!child.querySelector('.jupyter-widgets'),
      prompt: text(child.querySelector('.jp-OutputPrompt')).trim(),
      text: text(out),
    };
  });
  const all = sel => [...node.querySelectorAll(sel)];
  const notError = el => !el.closest('[data-workshop-output-type="error"]');  // tracebacks: reported as errors
  return {
    index,
    type: cell.model.type,
    count: cell.model.type === 'code' ? cell.model.executionCount : null,
    source: cell.model.sharedModel.getSource(),
    outputs,
    stderr: all('[data-mime-type="application/vnd.jupyter.stderr"]').filter(notError).map(text),
    widgetErrors: all('.jupyter-widgets, .jp-OutputArea-output')
      .filter(el => el.innerText.includes('Error displaying widget')).map(text).slice(0, 3),
    widgets: all('.jupyter-widgets').length,
    progressWidgets: all('.widget-progress, .widget-hprogress, .widget-vprogress, progress').length,
    richBars: all('pre').map(p => p.innerText.split('\\n').filter(l => l.includes('━')).length)
      .reduce((a, b) => a + b, 0),
    images: all('img').map(img => ({
      src: (img.getAttribute('src') || '').slice(0, 60), complete: img.complete,
      naturalWidth: img.naturalWidth, alt: img.alt, title: img.title,
      around: text(img.parentElement).trim().slice(0, 120),
    })),
  };
});
"""
)

JS_FILE_PICKER = """
if (window.__workshopPicker) return;
window.__workshopPicker = true;
const click = HTMLInputElement.prototype.click;
HTMLInputElement.prototype.click = function () {
  if (this.type !== 'file' || this.isConnected) return click.call(this);
  this.id = 'workshop-file-picker';
  this.style.display = 'block';
  document.body.appendChild(this);  // where Selenium can give it files, as the dialog would
};
"""

JS_IMAGES_SETTLED = (
    JS_PANEL
    + """
if (!panel) return false;
return [...panel.node.querySelectorAll('img')].every(img => img.complete);
"""
)

JS_SAVE_AND_SHUTDOWN = (
    JS_PANEL
    + """
const done = arguments[arguments.length - 1];
if (!panel) { done('no panel'); return; }
const json = panel.model.toJSON();
panel.context.save()
  .then(() => panel.sessionContext.shutdown())
  .then(() => done({notebook: json}), e => done({notebook: json, error: String(e)}));
"""
)

JS_SHUTDOWN = (
    JS_PANEL
    + """
const done = arguments[arguments.length - 1];
if (!panel) { done('no panel'); return; }
panel.sessionContext.shutdown().then(() => done('ok'), e => done(String(e)));
"""
)

JS_FULL_HEIGHT = (
    JS_PANEL
    + """
if (!panel) return 0;
window.jupyterapp.shell.collapseLeft();  // the notebook, not the file browser, in the picture
const outer = panel.node.querySelector('.jp-WindowedPanel-outer') || panel.content.node;
outer.scrollTop = 0;
const cells = panel.content.widgets;
if (!cells.length) return 0;
const bottom = cells[cells.length - 1].node.getBoundingClientRect().bottom - outer.getBoundingClientRect().top;
return Math.ceil(bottom + (window.innerHeight - outer.clientHeight) + 40);
"""
)

JS_SCROLL_TOP = (
    JS_PANEL
    + """
if (!panel) return;
(panel.node.querySelector('.jp-WindowedPanel-outer') || panel.content.node).scrollTop = 0;
"""
)


# --- the server and the browser ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM the process group of ``proc`` (it was started in a new session), then SIGKILL it."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)
            return


def wait_for(what: str, check, limit_s: float, every_s: float = 0.5, on_timeout=lambda: ""):
    """Poll ``check()`` until it returns something truthy; fail after ``limit_s`` with ``what``."""
    deadline = time.monotonic() + limit_s
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every_s)
    pytest.fail(f"{what}: not within {limit_s:g} s (last: {last!r}) {on_timeout()}".strip())


@dataclass
class Lab:
    """A JupyterLab server on a temporary root of prepared notebook copies, and a browser on it."""

    root: Path
    base: str
    token: str
    server: subprocess.Popen
    server_log: Path
    driver: Any = None

    def api(self, path: str, method: str = "GET") -> Any:
        req = urllib.request.Request(
            self.base + path, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - our own server on 127.0.0.1
            body = r.read()
        return json.loads(body) if body else None

    def log_tail(self, chars: int = 3000) -> str:
        text = self.server_log.read_text(errors="replace") if self.server_log.exists() else ""
        return f"\n--- server log ({self.server_log}), last lines ---\n{text[-chars:]}"

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)


def start_server(root: Path, work: Path, latent_cache: Path) -> Lab:
    token, port = secrets.token_hex(16), free_port()
    settings, workspaces = work / "lab-settings", work / "lab-workspaces"
    app_settings = work / "lab-app-settings"
    jupyter.install_lab_settings(app_settings)  # what `make lab` installs for attendees
    for name, value in LAB_SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    workspaces.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",  # as tests/conftest.py sets it for every test
        AZURE_CORE_COLLECT_TELEMETRY="false",
        # a first run's empty latent cache, as tests/conftest.py gives each test
        WORKSHOP_LATENT_CACHE=str(latent_cache),
        JUPYTER_CONFIG_DIR=str(work / "jupyter-config"),  # nobody's own jupyter_server_config
        JUPYTER_RUNTIME_DIR=str(work / "jupyter-runtime"),
        PYTHONUNBUFFERED="1",
    )
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
        "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={workspaces}",
        f"--LabApp.app_settings_dir={app_settings}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: its commands, shell and models
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        *jupyter.kernel_flags(),  # as `make lab` starts it
    ]  # fmt: skip
    if os.geteuid() == 0:  # a container's root: JupyterLab refuses root without it
        cmd.append("--allow-root")
    log = work / "jupyterlab.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    atexit.register(stop_process_group, server)  # even if pytest itself is interrupted
    lab = Lab(root=root, base=f"http://127.0.0.1:{port}", token=token, server=server, server_log=log)

    def up():
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited with {server.returncode}{lab.log_tail()}")
        with contextlib.suppress(OSError):
            return lab.api("/api/status")

    wait_for("JupyterLab server answering /api/status", up, SERVER_START_S, on_timeout=lab.log_tail)
    return lab


def start_browser(work: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = work / "chromium-profile"
    profile.mkdir()
    options.add_argument(f"--user-data-dir={profile}")
    options.unhandled_prompt_behavior = "accept"  # a "leave this page?" prompt must not stall a test
    # The explicit driver path skips Selenium Manager (it would try to download a driver).
    service = Service(
        executable_path=shutil.which("chromedriver"),
        log_output=str(work / "chromedriver.log"),
        popen_kw={"start_new_session": True},
    )
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(PAGE_READY_S)
    driver.set_script_timeout(120)
    return driver


def stop_browser(driver) -> None:
    proc = getattr(driver.service, "process", None)
    try:
        driver.quit()
    except Exception:  # noqa: BLE001 - the browser may already be gone; the group kill below ends it
        pass
    if proc is not None:
        stop_process_group(proc, grace_s=5)  # chromedriver and any Chromium it left behind


class LabRunner:
    """Runs notebooks in JupyterLab, one after another, each on the offline profile in ``root`` (the
    server's root and every kernel's working folder), where JupyterLab saves it executed. The server
    and the browser start with the first notebook; :meth:`close` stops both."""

    def __init__(self, root: Path, work: Path):
        self.root, self.work, self.lab = root, work, None

    def run(self, nb: Path) -> dict[str, Any]:
        import papermill

        papermill.execute_notebook(  # the parameters injected, nothing executed
            str(nb), str(self.root / nb.name), parameters=notebooks.tiny_profile(nb), prepare_only=True,
            kernel_name="python3", progress_bar=False,
        )  # fmt: skip
        if self.lab is None:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            self.lab = start_server(self.root, self.work, self.work / "latent-cache")
            self.lab.driver = start_browser(self.work)
        return run_in_lab(self.lab, self.root / nb.name)

    def close(self) -> None:
        if self.lab is None:
            return
        if self.lab.driver is not None:
            stop_browser(self.lab.driver)
        stop_process_group(self.lab.server)
        with contextlib.suppress(OSError):
            shutil.copy(self.lab.server_log, ARTIFACTS / "jupyterlab.log")


# --- one notebook in the lab ------------------------------------------------------------------


def open_notebook(lab: Lab, name: str) -> None:
    url = f"{lab.base}/lab/tree/{urllib.parse.quote(name)}?reset&token={lab.token}"
    lab.driver.get(url)
    wait_for(f"{name}: kernel ready in JupyterLab", lambda: lab.js(JS_READY, name) == "ready" or None,
             KERNEL_READY_S, on_timeout=lambda: f"(page says {lab.js(JS_READY, name)!r}){lab.log_tail()}")  # fmt: skip


def server_kernel_state(lab: Lab) -> str:
    try:
        return ",".join(k["execution_state"] for k in lab.api("/api/kernels")) or "none"
    except OSError as err:
        return f"error: {err}"


def run_all(lab: Lab, name: str, findings: list[str]) -> tuple[list[dict], bool]:
    """Run All; wait until no code cell is queued or running and the kernel is idle (``IDLE_POLLS`` in
    a row). Returns the kernel-status samples taken meanwhile and whether it finished in time."""
    started = lab.js(JS_RUN_ALL, name)
    if started != "started":
        pytest.fail(f"{name}: Run All did not start: {started}")
    samples, quiet, stalled, t0 = [], 0, 0, time.monotonic()
    while time.monotonic() - t0 < NOTEBOOK_LIMIT_S:
        time.sleep(POLL_S)
        state = lab.js(JS_STATE, name)
        if state is None:
            findings.append("the notebook panel disappeared during Run All")
            return samples, False
        state["t"] = round(time.monotonic() - t0, 1)
        state["server"] = server_kernel_state(lab)
        state.pop("counts")
        samples.append(state)
        quiet = quiet + 1 if not state["pending"] and state["kernel"] == "idle" else 0
        if quiet >= IDLE_POLLS:
            return samples, True
        stalled = stalled + 1 if state["pending"] and "busy" not in state["server"] else 0
        if stalled * POLL_S >= STALL_S:
            findings.append(
                f"Run All stalled: {len(state['pending'])} code cells still queued while the kernel "
                f"read idle for {STALL_S} s"
            )
            return samples, False
    findings.append(
        f"Run All still running after {NOTEBOOK_LIMIT_S} s (hard limit, the kernel interrupted); "
        f"{len(state['pending'])} code cells still queued or running"
    )
    with contextlib.suppress(OSError):
        for k in lab.api("/api/kernels"):
            lab.api(f"/api/kernels/{k['id']}/interrupt", method="POST")
    return samples, False


def click_accelerate_form(lab: Lab, findings: list[str]) -> None:
    """Notebook 03: point the form at a new folder, click its button, expect the YAML files there."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    folder = "accelerate_configs_from_the_form"
    driver = lab.driver
    try:
        button = driver.find_element(By.XPATH, "//button[normalize-space()='Write the config files']")
        field_ = driver.find_element(
            By.XPATH, "//div[contains(@class,'widget-text')][.//label[normalize-space()='folder']]//input"
        )
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", button)
        field_.clear()
        field_.send_keys(folder)
        time.sleep(1)  # the Text widget syncs its value to the kernel as it changes
        button.click()
    except WebDriverException as err:
        findings.append(f"accelerate form: cannot use it: {type(err).__name__}: {err.msg}")
        return
    target = lab.root / folder

    def written():
        files = sorted(target.glob("*.yaml")) if target.is_dir() else []
        shown = driver.find_elements(
            By.XPATH, "//div[contains(@class,'jupyter-widgets')]//pre[contains(., 'wrote')]"
        )
        return files if files and shown else None

    deadline = time.monotonic() + FORM_WRITE_S
    while time.monotonic() < deadline and not written():
        time.sleep(0.5)
    if not written():
        findings.append(
            f"accelerate form: clicking 'Write the config files' wrote no YAML file to {folder}/ "
            f"(or did not say 'wrote') within {FORM_WRITE_S} s"
        )


def _png(size: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), (20, 160, 150)).save(out, format="PNG")
    return out.getvalue()


def upload_pictures(lab: Lab, findings: list[str]) -> None:
    """Notebook 02: upload a good picture and three bad files through its form, as a person picks them
    in the browser's file dialog; only the good one may land in my_pictures/, each bad one gets its line."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    good = _png(96)
    files = {
        "duck.png": good,
        "notes.txt": b"not a picture\n",
        "small.png": _png(16),
        "broken.png": good[:200],
    }
    picked = Path(tempfile.mkdtemp(prefix="lab-upload-", dir=lab.server_log.parent))  # the test's work folder
    for name, content in files.items():
        (picked / name).write_bytes(content)
    driver = lab.driver
    try:
        # ipywidgets' upload button clicks a file <input> it never puts in the page (the browser's file
        # dialog); here that click puts the input in the page instead, and Selenium picks the files in it.
        driver.execute_script(JS_FILE_PICKER)
        button = driver.find_element(By.CSS_SELECTOR, ".widget-upload")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", button)
        button.click()
        picker = driver.find_element(By.ID, "workshop-file-picker")
        picker.send_keys("\n".join(str(picked / name) for name in files))
    except WebDriverException as err:
        findings.append(f"upload form: cannot use it: {type(err).__name__}: {err.msg}")
        return
    folder = lab.root / "my_pictures"

    def answered():
        shown = driver.find_elements(
            By.XPATH, "//div[contains(@class,'jupyter-widgets')]//pre[contains(., 'kept')]"
        )
        return shown[0].text if shown else None

    deadline = time.monotonic() + FORM_WRITE_S
    while time.monotonic() < deadline and not answered():
        time.sleep(0.5)
    text = answered() or ""
    kept = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if kept != ["duck.png"] or (folder / "duck.png").read_bytes() != good:
        findings.append(f"upload form: my_pictures/ holds {kept}, expected only duck.png")
    for name, why in (
        ("notes.txt", "not a picture"),
        ("small.png", "16x16 px is smaller"),
        ("broken.png", "corrupt"),
    ):
        if not any(line.startswith(f"refused {name}: ") and why in line for line in text.splitlines()):
            findings.append(f"upload form: no line saying why {name} was refused ({why!r}) in {text[:300]!r}")
    grid = driver.find_elements(By.XPATH, "//div[contains(@class,'jupyter-widgets')]//img")
    if not any(img.get_property("naturalWidth") for img in grid):
        findings.append("upload form: no picture grid shown after the upload")


def last_statement_is_record(source: str) -> bool:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    if not body or not isinstance(body[-1], ast.Expr) or not isinstance(body[-1].value, ast.Call):
        return False
    func = body[-1].value.func
    return getattr(func, "attr", getattr(func, "id", None)) == "record"


def reopened_findings(lab: Lab, name: str, bars_when_run: int) -> list[str]:
    """The saved notebook opened again once its kernel has gone, as an attendee opens it the next
    day: every progress bar drawn again from the widget state saved in the notebook (``make lab``'s
    saveState), none reading "Error displaying widget"."""
    open_notebook(lab, name)
    drawn, errors, deadline = 0, [], time.monotonic() + REOPEN_S
    while time.monotonic() < deadline and drawn < bars_when_run and not errors:
        time.sleep(POLL_S)  # the widget manager restores the models after the panel is ready
        cells = lab.js(JS_INSPECT, name) or []
        drawn = sum(c["progressWidgets"] for c in cells)
        errors = [e for c in cells for e in c["widgetErrors"]]
    lab.driver.execute_async_script(JS_SHUTDOWN, name)  # the kernel the reopening started; no save
    found = [f"reopened: an output reads {e!r}" for e in errors[:3]]
    if drawn < bars_when_run:
        found.append(
            f"reopened: {drawn} of the {bars_when_run} progress bars drawn from the saved widget state"
        )
    return found


def findings_on_screen(cells: list[dict]) -> list[str]:
    """What a person would call broken, cell by cell (indices as in the notebook, from 0)."""
    found = []
    for c in cells:
        where = f"cell {c['index']} ({c['type']})"
        for img in c["images"]:
            if img["naturalWidth"] == 0:
                about = img["alt"] or img["title"] or img["around"] or img["src"]
                found.append(f"{where}: broken image ({about!r}, src {img['src']!r})")
        for out in c["outputs"]:
            if out["type"] == "error":
                found.append(f"{where}: error output: {out['ename']}: {(out['evalue'] or '')[:300]}")
        for text in c["stderr"]:
            found.append(f"{where}: stderr output shown in red: {text.strip()[:300]!r}")
        for text in c["widgetErrors"]:
            found.append(f"{where}: widget not displayed: {text.strip()[:120]!r}")
        for out in c["outputs"]:
            text = out["text"]
            # A widget the page cannot draw falls back to its text ("  0%|   | 0/200", "HBox(...)"); a
            # launcher relaying its processes' bars on stdout is by design, and stderr is reported above.
            as_text = out["widgetView"] and not out["widgetDrawn"]
            if as_text or (out["mime"] == "text/plain" and re.search(r"\d+%\|", text)):
                found.append(f"{where}: a progress bar or widget shown as text, not a widget: {text[:120]!r}")
            if (
                out["type"] == "execute_result"
                and c["type"] == "code"
                and last_statement_is_record(c["source"])
            ):
                found.append(f"{where}: stray {out['prompt'] or 'Out'} of a record() call: {text[:120]!r}")
        bars = c["progressWidgets"] + c["richBars"]
        if bars > MAX_BARS_PER_CELL:
            found.append(
                f"{where}: {bars} progress bars ({c['progressWidgets']} widgets, {c['richBars']} rich text bars; "
                f"more than {MAX_BARS_PER_CELL})"
            )
    return found


def findings_in_kernel_status(samples: list[dict], code_cell_index: list[int]) -> list[str]:
    """The status bar must not read Idle while a cell runs (a few seconds between cells aside), and
    where a cell ran that long, it must have read Busy."""
    found, streak = [], []
    running = [s for s in samples if s["pending"]]
    if len(running) * POLL_S >= IDLE_WHILE_RUNNING_S and not any("| Busy" in s["statusbar"] for s in running):
        found.append(f"the status bar never read 'Busy' in {len(running)} samples taken while cells ran")
    for s in [*samples, None]:
        idle = s is not None and s["pending"] and "| Idle" in s["statusbar"]
        if idle:
            streak.append(s)
            continue
        if len(streak) * POLL_S >= IDLE_WHILE_RUNNING_S:
            cell = code_cell_index[streak[0]["pending"][0]]
            found.append(
                f"cell {cell} (code): the status bar reads 'Idle' (server: {streak[-1]['server']}) for "
                f"{streak[-1]['t'] - streak[0]['t']:.0f} s while the cell runs (t={streak[0]['t']}..{streak[-1]['t']} s)"
            )
        streak = []
    return found


def screenshot(lab: Lab, name: str, path: Path) -> None:
    """The whole notebook in one picture: the viewport as tall as the notebook's content."""
    driver = lab.driver
    height = min(int(lab.js(JS_FULL_HEIGHT, name) or WINDOW[1]), 30000)
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": WINDOW[0], "height": max(height, WINDOW[1]), "deviceScaleFactor": 1, "mobile": False},
    )
    try:
        time.sleep(1.5)  # Lumino lays the panels out again on the resize
        lab.js(JS_SCROLL_TOP, name)
        time.sleep(0.5)
        path.write_bytes(driver.get_screenshot_as_png())
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def cell_seconds(nb: Path) -> dict[int, float]:
    """Seconds each code cell of the saved notebook ran, by cell index, from the timestamps JupyterLab
    records (``recordTiming``): from the kernel starting the cell to its reply."""
    seconds = {}
    for index, cell in enumerate(json.loads(nb.read_text())["cells"]):
        times = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in times and "shell.execute_reply" in times:
            start, end = (
                datetime.fromisoformat(times[k]) for k in ("iopub.execute_input", "shell.execute_reply")
            )
            seconds[index] = round((end - start).total_seconds(), 1)
    return seconds


def run_in_lab(lab: Lab, nb: Path) -> dict[str, Any]:
    """Open ``nb`` (in the server's root), Run All, use its forms, look, save it in place; its report
    (what JupyterLab showed that a person would call broken: ``findings``) is written beside it as
    ``<notebook>.lab.json`` and returned. Copies of both and a screenshot go to ``build/lab``."""
    name, findings = nb.name, []
    t0 = time.monotonic()
    open_notebook(lab, name)
    opened = time.monotonic()
    samples, finished = run_all(lab, name, findings)
    ran = time.monotonic()
    if finished and nb.stem.startswith("03_"):
        click_accelerate_form(lab, findings)
    if finished and nb.stem.startswith("02_"):
        upload_pictures(lab, findings)
    wait_for(f"{name}: images loaded or failed", lambda: lab.js(JS_IMAGES_SETTLED, name), 30)
    cells = lab.js(JS_INSPECT, name)
    shot = ARTIFACTS / f"{nb.stem}.png"
    screenshot(lab, name, shot)
    saved = lab.driver.execute_async_script(JS_SAVE_AND_SHUTDOWN, name)
    if saved.get("error"):
        findings.append(f"saving the notebook failed: {saved['error']}")
    records = notebooks.read_records(nb)
    seconds = cell_seconds(nb)
    bars = sum(c["progressWidgets"] for c in cells)
    if bars:
        findings += reopened_findings(lab, name, bars)

    code = [c for c in cells if c["type"] == "code"]
    not_run = [c["index"] for c in code if c["count"] is None]
    if not_run:
        findings.append(f"code cells not executed: {not_run} of {len(code)}")
    findings += findings_on_screen(cells)
    findings += findings_in_kernel_status(samples, [c["index"] for c in code])
    if "without encryption" in lab.server_log.read_text(errors="replace"):  # jupyter.kernel_flags()
        findings.append("a kernel warned that its sockets are not encrypted (the server's log)")
    idle_busy = [s for s in samples if s["pending"] and (s["kernel"] == "idle" or "Idle" in s["statusbar"])]
    report = {
        "notebook": name,
        "seconds_to_kernel_ready": round(opened - t0, 1),
        "seconds_run_all": round(ran - opened, 1),
        "code_cells": len(code),
        "cells_run": len(code) - len(not_run),
        "findings": findings,
        "records": sorted(records),
        "screenshot": str(shot),
        "samples_idle_while_a_cell_runs": len(idle_busy),
        "seconds_per_cell": seconds,
        "cells": [
            {k: c[k] for k in ("index", "type", "count", "widgets", "progressWidgets", "richBars")}
            | {"outputs": [f"{o['type']}:{o['mime']}" for o in c["outputs"]], "stderr": len(c["stderr"])}
            for c in cells
        ],
        "kernel_samples": samples,
    }
    report_path = nb.with_suffix(".lab.json")
    report_path.write_text(json.dumps(report, indent=1))
    for path in (nb, report_path):
        shutil.copy(path, ARTIFACTS / path.name)
    return report
