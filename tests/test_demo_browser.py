"""`unclip serve` in a real headless Chromium: the page loads, a typed prompt and the Generate
button give images of the pipeline's resolution in the gallery; the Interpolate tab gives its
frames. A DALL-E pipeline's page does the same on its one tab.

Needs Debian's chromium and chromium-driver and the selenium and gradio packages (the README's test
command installs them). Without them the test is skipped, unless UNCLIP_REQUIRE_BROWSER is set (as
the README's test command does for CI), which makes their absence a failure.
"""

import importlib.util
import os
import shutil
import socket
from contextlib import contextmanager

import pytest
from conftest import token_pipeline

REQUIRED = bool(os.environ.get("UNCLIP_REQUIRE_BROWSER"))
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = [
    name
    for name, absent in (
        ("chromium (apt-get install chromium)", CHROMIUM is None),
        ("chromedriver (apt-get install chromium-driver)", CHROMEDRIVER is None),
        ("selenium (pip install -e '.[test]')", importlib.util.find_spec("selenium") is None),
        ("gradio (pip install -e '.[demo]')", importlib.util.find_spec("gradio") is None),
    )
    if absent
]
if not MISSING:
    # gradio takes seconds to import: once at collection (shared with test_demo.py), not per test
    import unclip.demo.app  # noqa: F401

pytestmark = pytest.mark.skipif(
    bool(MISSING) and not REQUIRED,
    reason=f"needs {', '.join(MISSING)} (set UNCLIP_REQUIRE_BROWSER=1 to fail instead)",
)

# what a headless Chromium needs here: root (no sandbox), no GPU, and none of its own network
# traffic (updates, sync, QUIC), which a closed network refuses and which would slow every start
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1000",
)
FEW = {"prior": 2, "decoder": 2, "sr32": 1, "sr64": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(pipe, folder):
    """``unclip serve`` on ``pipe`` saved to ``folder``, on a free localhost port, its server in a
    background thread; yields ``(url, resolution)``."""
    if MISSING:
        pytest.fail(f"UNCLIP_REQUIRE_BROWSER is set but this machine lacks {', '.join(MISSING)}")
    from unclip.cli import serve

    pipe.save_pretrained(folder)
    port = free_port()
    args = ["--model", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    demo = serve.start(serve.build_parser().parse_args(args), block=False)
    try:
        yield f"http://127.0.0.1:{port}/", pipe.resolution
    finally:
        demo.close()


@pytest.fixture
def served(tmp_path):
    """A tiny random unCLIP pipeline (few steps) served: ``(url, resolution)``."""
    from unclip.pipeline.tiny import tiny_pipeline

    pipe = tiny_pipeline(seed=0)
    for stage, steps in FEW.items():
        pipe.sampling[stage].steps = steps
    with serving(pipe, tmp_path / "model") as served:
        yield served


@pytest.fixture
def served_tokens(tmp_path, token_parts):
    """A tiny random DALL-E pipeline (16 image tokens, then two upsamplers) served."""
    with serving(token_pipeline(token_parts), tmp_path / "dalle") as served:
        yield served


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    # an explicit driver path: selenium then looks nothing up and downloads nothing
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for_images(driver, gallery: str, tmp_path, count: int = 1) -> list:
    """``[[naturalWidth, naturalHeight]]`` of the loaded images in the gallery with id ``gallery``
    once ``count`` of them have loaded (they arrive one by one); a failure names what the page
    shows (an error message, say)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def loaded(d):
        sizes = d.execute_script(
            f"return Array.from(document.querySelectorAll('#{gallery} img'))"
            ".filter(im => im.complete && im.naturalWidth > 0)"
            ".map(im => [im.naturalWidth, im.naturalHeight]);"
        )
        return sizes if len(sizes) >= count else False

    try:
        return WebDriverWait(driver, 90).until(loaded)
    except TimeoutException:
        driver.save_screenshot(str(tmp_path / "page.png"))
        text = driver.find_element(By.TAG_NAME, "body").text
        pytest.fail(
            f"fewer than {count} images in #{gallery}; screenshot {tmp_path / 'page.png'}; "
            f"page: {text}"
        )


def test_generate_and_interpolate_in_the_browser(served, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, resolution = served
    browser.get(url)
    prompt = WebDriverWait(browser, 60).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#prompt textarea")
    )
    prompt.send_keys("a small red circle on the left")
    browser.find_element(By.ID, "generate").click()

    sizes = wait_for_images(browser, "gallery", tmp_path)
    assert sizes and all(s == [resolution, resolution] for s in sizes), sizes

    # another tab through the same server: interpolation's frames (5 by default)
    browser.find_element(
        By.XPATH, "//button[@role='tab' and normalize-space()='Interpolate']"
    ).click()
    WebDriverWait(browser, 30).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#start-prompt textarea").is_displayed()
    )
    browser.find_element(By.CSS_SELECTOR, "#start-prompt textarea").send_keys("a red circle")
    browser.find_element(By.CSS_SELECTOR, "#end-prompt textarea").send_keys("a blue square")
    browser.find_element(By.ID, "interpolate").click()
    frames = wait_for_images(browser, "interpolate-gallery", tmp_path, count=5)
    assert frames == [[resolution, resolution]] * 5


def test_generate_with_a_token_pipeline_in_the_browser(served_tokens, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, resolution = served_tokens
    browser.get(url)
    prompt = WebDriverWait(browser, 60).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "#prompt textarea")
    )
    prompt.send_keys("a small red circle on the left")
    browser.find_element(By.ID, "generate").click()
    sizes = wait_for_images(browser, "gallery", tmp_path, count=4)  # the page asks 4 by default
    assert sizes == [[resolution, resolution]] * 4
    tabs = browser.find_elements(By.XPATH, "//button[@role='tab']")
    assert [t.text.strip() for t in tabs] == ["Generate"]
