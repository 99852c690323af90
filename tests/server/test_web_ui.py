"""The web page at `/`, in a real browser: headless Chromium (Debian's chromium and chromium-driver, which .ci/run
installs) driven by Selenium, against live servers. A chat message gets its answer streamed onto the page; the
memory bar's numbers are /v1/memory's; the live KV chart moves while 8 requests run; with an API key, a wrong key
shows the server's own error and the right one opens the page; the page's files are small and fetch nothing from
elsewhere. Each view's screenshot is written to $PAGEDLLM_SCREENSHOTS (docs/images holds the README's)."""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import httpx
import pytest

from pagedllm.entrypoints.openai.routes import WEB_DIR
from tests.server.conftest import API_KEY, AUTH

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    # .ci/run installs them (and says so): there, a missing browser is a failure, never a skip.
    if os.environ.get("PAGEDLLM_REQUIRE_BROWSER") == "1":
        raise RuntimeError("chromium and chromedriver are not installed (Debian: apt-get install chromium "
                           "chromium-driver)")
    pytest.skip("the browser tests need Debian's chromium and chromium-driver (.ci/run installs them)",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WAIT_S = 60


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("PAGEDLLM_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium with the flags a machine with no internet needs (no background networking)."""
    options = Options()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,860"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, what: str):
    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(lambda d: condition(d))
    except Exception:
        pytest.fail(f"the page did not show {what} within {WAIT_S} s; its error box: "
                    f"{driver.find_element(By.ID, 'error').text!r}")


def _text(driver, selector: str) -> str | None:
    """The text of the last element `selector` finds (None: none), read in the page (its views redraw)."""
    return driver.execute_script(f"const all = document.querySelectorAll({selector!r}); "
                                 f"return all.length ? all[all.length - 1].textContent : null")


def _open(driver, url: str) -> None:
    driver.get(url + "/")
    _wait(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true",
          "the served model (GET /v1/models)")


def test_a_chat_message_is_answered_on_the_page_as_it_streams(browser, demo_server, screenshots):
    _open(browser, demo_server.url)
    # Count the answer's text changes: a streamed answer grows in several steps.
    browser.execute_script("""
        window.__updates = 0;
        new MutationObserver(() => window.__updates++).observe(document.getElementById('messages'),
            {subtree: true, characterData: true, childList: true});""")
    browser.find_element(By.CSS_SELECTOR, "#settings summary").click()  # (the sampling settings, folded)
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("24")
    browser.find_element(By.ID, "prompt").send_keys("Tell me a story.")
    browser.find_element(By.ID, "send").click()
    stats = _wait(browser, lambda d: _text(d, ".message.assistant .stats"), "the answer's token counts")
    answer, user = _text(browser, ".message.assistant .text"), _text(browser, ".message.user .text")
    assert answer.strip() and "tokens/s" in stats and "first token" in stats, stats
    assert browser.execute_script("return window.__updates") >= 4  # pieces, not one whole reply
    assert user == "Tell me a story."
    stored = browser.execute_script("return JSON.parse(localStorage.getItem('pagedllm.conversations'))")
    assert stored[0]["messages"][-1]["content"] == answer  # kept in the browser's storage
    browser.save_screenshot(str(screenshots / "web-chat.png"))


def test_the_memory_bar_shows_what_v1_memory_says(browser, demo_server, screenshots):
    _open(browser, demo_server.url)
    browser.find_element(By.CSS_SELECTOR, "nav button[data-view=memory]").click()
    # (read in one call: the page redraws the bar every second)
    shown = _wait(browser, lambda d: d.execute_script("""
        const s = [...document.querySelectorAll('#memory-bar .segment')];
        return s.length ? Object.fromEntries(s.map(x => [x.dataset.field, Number(x.dataset.bytes)])) : null;"""),
                  "the memory bar")
    memory = httpx.get(f"{demo_server.url}/v1/memory", timeout=30).json()
    for field in ("weights_bytes", "activation_peak_bytes", "overhead_bytes", "kv_cache_bytes", "device_used_bytes"):
        if memory[field] > 0:
            assert shown[field] == memory[field], field
    assert "KV cache" in browser.find_element(By.ID, "memory-legend").text
    _wait(browser, lambda d: d.find_element(By.ID, "kv-chart").find_elements(By.TAG_NAME, "polyline"),
          "the KV chart")


def test_the_live_kv_chart_moves_while_8_requests_run(browser, demo_server, screenshots):
    _open(browser, demo_server.url)
    browser.find_element(By.CSS_SELECTOR, "nav button[data-view=memory]").click()

    def values(chart: str) -> list[float]:
        text = browser.execute_script(f"const l = document.querySelector('#{chart} polyline'); "
                                      f"return l ? l.dataset.values : ''")
        return [float(v) for v in text.split(",") if v]

    def ask() -> None:
        httpx.post(f"{demo_server.url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 1600,
                                                                "ignore_eos": True}, timeout=300)  # (seconds each)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        _wait(browser, lambda d: sum(v > 0 for v in values("kv-chart")) >= 3, "KV blocks in use on the live chart")
        assert max(values("requests-chart")) >= 1
        browser.save_screenshot(str(screenshots / "web-memory.png"))
    finally:
        for t in threads:
            t.join()


def test_a_wrong_key_shows_the_servers_error(browser, server_url, screenshots):
    browser.get(server_url + "/")  # (the page itself needs no key; the API does)
    dialog = _wait(browser, lambda d: d.find_element(By.ID, "key-dialog").get_attribute("open") is not None and
                   d.find_element(By.ID, "key-dialog"), "the API key dialog")
    dialog.find_element(By.ID, "key-input").send_keys("sk-wrong")
    dialog.find_element(By.ID, "key-save").click()
    error = _wait(browser, lambda d: d.find_element(By.ID, "error").text, "an error")
    wrong = httpx.get(f"{server_url}/v1/models", headers={"Authorization": "Bearer sk-wrong"}).json()
    assert error == f"401: {wrong['error']['message']}"
    browser.save_screenshot(str(screenshots / "web-api-key.png"))
    dialog = browser.find_element(By.ID, "key-dialog")
    _wait(browser, lambda d: dialog.get_attribute("open") is not None, "the dialog again")
    key = dialog.find_element(By.ID, "key-input")
    key.clear()
    key.send_keys(API_KEY)
    dialog.find_element(By.ID, "key-save").click()
    _wait(browser, lambda d: d.find_element(By.ID, "model-name").text == "tiny", "the model, with the right key")
    assert browser.execute_script("return sessionStorage.getItem('pagedllm.key')") == API_KEY
    assert browser.execute_script("return localStorage.getItem('pagedllm.key')") is None  # this tab only


def test_the_page_is_small_and_self_contained(server_url):
    files = {p.name: p for p in WEB_DIR.iterdir()}
    assert set(files) == {"index.html", "app.js", "style.css"}
    assert sum(p.stat().st_size for p in files.values()) < 200_000
    for p in files.values():
        text = p.read_text()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    index = httpx.get(server_url + "/")  # no key needed for the page's files
    assert index.status_code == 200 and "/web/app.js" in index.text
    assert httpx.get(server_url + "/web/app.js").status_code == 200
    assert httpx.get(server_url + "/v1/models").status_code == 401  # the API still does
    assert httpx.get(server_url + "/v1/models", headers=AUTH).status_code == 200


@pytest.fixture(scope="module")
def speech_url(tmp_path_factory):
    """A tiny Higgs Audio v2 with its audio tokenizer and a voice preset."""
    import sys

    import soundfile as sf

    from tests.audio_helpers import make_tiny_audio_tokenizer, make_tiny_higgs_tts, sine_wave
    from tests.server.conftest import _stop_server, start_command

    root = tmp_path_factory.mktemp("web-speech")
    (root / "voices").mkdir()
    sf.write(root / "voices" / "alice.wav", sine_wave(0.6), 24000)
    (root / "voices" / "alice.txt").write_text("Hello there.")
    sf.write(root / "reference.wav", sine_wave(0.5), 24000)
    model, codec = make_tiny_higgs_tts(root / "model"), make_tiny_audio_tokenizer(root / "codec")
    proc, url = start_command(lambda port: [
        sys.executable, "-m", "pagedllm", "serve", str(model), "--audio-tokenizer-path", str(codec), "--port",
        str(port), "--max-model-len", "512", "--voice-presets-dir", str(root / "voices")], root)
    yield url, root / "reference.wav"
    _stop_server(proc)


def test_an_audio_model_speaks_on_the_page_with_a_preset_or_a_reference_clip(browser, speech_url, screenshots):
    url, reference = speech_url
    _open(browser, url)
    tab = _wait(browser, lambda d: d.find_element(By.ID, "speech-tab").is_displayed() and
                d.find_element(By.ID, "speech-tab"), "the speech view (an audio model)")
    tab.click()
    voices = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#voice option")]
    assert voices == ["", "alice"]
    browser.find_element(By.CSS_SELECTOR, "#voice option[value=alice]").click()
    browser.find_element(By.ID, "speak").click()
    status = _wait(browser, lambda d: "s of audio" in (_text(d, "#speech-status") or "") and
                   _text(d, "#speech-status"), "the streamed speech")
    assert float(status.split()[0]) > 0 and browser.find_element(By.ID, "speech-download").is_displayed()
    browser.save_screenshot(str(screenshots / "web-speech.png"))
    browser.execute_script("document.getElementById('speech-status').textContent = ''")
    browser.find_element(By.ID, "reference-clip").send_keys(str(reference))  # voice cloning: chat with the clip
    browser.find_element(By.ID, "reference-text").send_keys("Hello there.")
    browser.find_element(By.ID, "speak").click()
    _wait(browser, lambda d: "s of audio" in (_text(d, "#speech-status") or ""), "speech in the clip's voice")
    assert browser.find_element(By.ID, "error").text == ""
