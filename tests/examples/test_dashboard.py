"""The VisualDL dashboard shows what examples/hapitrain.py logged, in a real (headless) browser.

Trains the example for 3 steps on small IDX files, serves its logs with ``visualdl``, opens
the scalar page in headless Chromium driven by Selenium (Debian's ``chromium`` and
``chromium-driver``; nothing is downloaded) and checks that every train and eval tag is
drawn as a chart with its points. The page draws tag names inside each chart's canvas
(ECharts titles), not as DOM text, so the names are read from the ECharts instances of
the page; the group headers ("eval" 3, "train" 4) are DOM text. The example runs twice:
each run writes into its own ``visualdl_log/version_<N>`` and the dashboard, opened on
``visualdl_log``, shows both runs. The screenshot stays in pytest's tmp_path; its path is printed.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from dist_helpers import run_python
from idx_files import make_mnist_dir

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hapitrain.py"
TRAIN_TAGS = ("train/loss", "train/acc_top1", "train/acc_top2", "train/lr")
EVAL_TAGS = ("eval/loss", "eval/acc_top1", "eval/acc_top2")
PACKAGES = ("chromium", "chromium-driver")
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--window-size=1400,900",
)

# Reads each chart's title, point counts and series (run) names from the page's own ECharts module (the
# same module URL gives the same instance registry). VisualDL 2.5 serves it here.
READ_CHARTS = """
const done = arguments[arguments.length - 1];
import('/app/__snowpack__/pkg/echarts.js').then(echarts => done(
    [...document.querySelectorAll('[_echarts_instance_]')].map(element => {
        const chart = echarts.getInstanceByDom(element);
        const option = chart ? chart.getOption() : {};
        return {title: ((option.title || [])[0] || {}).text || null,
                points: Math.max(0, ...(option.series || []).map(s => (s.data || []).length)),
                series: (option.series || []).map(s => s.name || '')};
    }))).catch(error => done(String(error)));
"""
GROUP_HEADERS = """
return [...document.querySelectorAll('h3')].map(h => [h.textContent.trim(),
    ((h.parentElement.querySelector('.total') || {}).textContent || '').trim()]);
"""


def _fail_or_skip(reason: str):
    if os.environ.get("CI"):
        pytest.fail(
            f"CI must provide this (.ci/run installs it with the README's test command): {reason}"
        )
    print(f"\nSKIPPED: {reason}")
    pytest.skip(reason)


def _browser() -> tuple[str, str]:
    """Paths of chromium and chromedriver (the README's test command installs both)."""
    found = shutil.which("chromium"), shutil.which("chromedriver")
    if not all(found):
        _fail_or_skip(
            f"chromium or chromedriver is not installed (apt-get install -y {' '.join(PACKAGES)})"
        )
    return found


def _visualdl_command() -> list[str]:
    script = pathlib.Path(sys.executable).with_name("visualdl")  # the console script pip installed
    if script.exists():
        return [str(script)]
    # `python -m visualdl` does not work (no __main__); the console script calls this main.
    return [
        sys.executable,
        "-c",
        "import sys; from visualdl.server.app import main; sys.exit(main())",
    ]


def _wait_for_api(
    url: str, server: subprocess.Popen, log: pathlib.Path, deadline_s: float = 30
) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        if server.poll() is not None:
            pytest.fail(f"visualdl exited with {server.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return json.load(response)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"visualdl did not answer {url} within {deadline_s} s:\n{log.read_text()}"
                )
            time.sleep(0.1)


def _wait(driver, predicate, what: str, timeout_s: float = 30):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(lambda d: predicate(d))
    except TimeoutException:
        pytest.fail(
            f"the scalar page did not show {what} within {timeout_s} s; page text:\n"
            f"{driver.execute_script('return document.body.innerText')}"
        )


def test_visualdl_dashboard_shows_hapitrain_scalars(tmp_path, free_port):
    started = time.monotonic()
    chromium, chromedriver = _browser()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _fail_or_skip("selenium is not installed (pip install -e '.[test]')")

    # 1. Train twice: --num-iters 3 on 64 images (one batch per epoch) runs 3 epochs, so each
    #    train tag gets 3 points (a line); evaluate runs once (one point per eval tag). Each
    #    run writes into its own visualdl_log/version_<N>, so the second hides nothing.
    data = make_mnist_dir(tmp_path / "data", n_train=64, n_test=32)
    out = tmp_path / "out"
    logdir = out / "visualdl_log"
    for version in ("version_0", "version_1"):
        trained = run_python(
            [str(EXAMPLE), "--data-root", str(data), "--num-iters", "3", "--output", str(out)],
            120,
            {**os.environ, "PYTHONUNBUFFERED": "1"},
            cwd=tmp_path,
        )
        assert trained.returncode == 0, trained.stdout + trained.stderr
        assert f"VisualDL log: {logdir / version} (visualdl --logdir {logdir} " in trained.stdout
        assert len(list((logdir / version).glob("vdlrecords.*.log"))) == 1
    assert sorted(p.name for p in logdir.iterdir()) == ["version_0", "version_1"]

    server_log = tmp_path / "visualdl.out"
    base = f"http://127.0.0.1:{free_port}"
    server = driver = None
    with open(server_log, "w") as log_handle:
        try:
            # 2. Serve the parent directory; the JSON API answers without a browser, and
            #    lists each version directory as a run.
            launched = time.monotonic()
            server = subprocess.Popen(
                [
                    *_visualdl_command(),
                    "--logdir",
                    str(logdir),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(free_port),
                    "--language",
                    "en",
                    "--disable-telemetry",
                ],
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            answer = _wait_for_api(f"{base}/app/api/scalar/tags", server, server_log)
            print(f"\nvisualdl answered {time.monotonic() - launched:.2f} s after its start")
            assert answer["status"] == 0
            runs = answer["data"]["runs"]
            assert sorted(pathlib.PurePath(run).name for run in runs) == [
                "version_0",
                "version_1",
            ], runs
            assert all(
                set(TRAIN_TAGS + EVAL_TAGS) <= set(tags) for tags in answer["data"]["tags"]
            ), answer

            # 3. Open the scalar page in headless Chromium.
            options = webdriver.ChromeOptions()
            options.binary_location = chromium
            for arg in (*CHROMIUM_ARGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"):
                options.add_argument(arg)
            driver = webdriver.Chrome(
                options=options, service=Service(executable_path=chromedriver)
            )
            driver.set_page_load_timeout(30)
            driver.set_script_timeout(10)
            driver.get(f"{base}/app/scalar")

            # Group headers are DOM text: "eval" with 3 charts, "train" with 4.
            def headers(d):
                found = dict(d.execute_script(GROUP_HEADERS))
                return found if {"eval", "train"} <= set(found) else None

            groups = _wait(driver, headers, 'the groups "eval" and "train"')
            assert groups["eval"] == str(len(EVAL_TAGS)) and groups["train"] == str(
                len(TRAIN_TAGS)
            ), groups

            def charts(d):
                found = d.execute_async_script(READ_CHARTS) or []
                assert isinstance(found, list), f"reading the charts failed: {found}"
                return {c["title"]: c["points"] for c in found if c["title"] and c["points"]}

            def charts_of(tags):
                return lambda d: (lambda shown: shown if set(tags) <= set(shown) else None)(
                    charts(d)
                )

            # Only the first group (eval) is open on arrival; open "train" if it is closed.
            _wait(driver, charts_of(EVAL_TAGS), "the eval charts")
            if not set(TRAIN_TAGS) <= set(charts(driver)):
                driver.execute_script("""[...document.querySelectorAll('h3')]
                    .find(h => h.textContent.trim() === 'train').parentElement.click();""")
            shown = _wait(
                driver,
                charts_of(TRAIN_TAGS + EVAL_TAGS),
                "every train and eval chart with its points",
            )
            print(f"charts shown (title: points): {shown}")
            # every chart draws both runs (its series are named after the run directories)
            drawn = {
                c["title"]: sorted({pathlib.PurePath(name).name for name in c["series"] if name})
                for c in driver.execute_async_script(READ_CHARTS)
                if c["title"]
            }
            assert all(
                drawn[tag] == ["version_0", "version_1"] for tag in TRAIN_TAGS + EVAL_TAGS
            ), drawn
            assert all(shown[tag] == 3 for tag in TRAIN_TAGS), shown
            assert all(shown[tag] == 1 for tag in EVAL_TAGS), shown

            # 4. Screenshot of the whole page (the window grown to the page's height).
            time.sleep(1)  # let the last charts finish their entry animation
            height = driver.execute_script("return document.documentElement.scrollHeight")
            frame = driver.execute_script("return window.outerHeight - window.innerHeight")
            driver.set_window_size(1400, height + frame)
            time.sleep(0.5)
            screenshot = tmp_path / "dashboard.png"
            assert driver.save_screenshot(str(screenshot))
        finally:
            if driver is not None:
                driver.quit()  # also stops chromedriver
            if server is not None:
                server.terminate()
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(timeout=10)

    from PIL import Image

    with Image.open(screenshot) as image:
        assert image.width == 1400 and image.height >= 900, image.size
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20) or ()) > 50  # not a blank page
    print(f"screenshot: {screenshot}")
    print(f"test took {time.monotonic() - started:.1f} s")
