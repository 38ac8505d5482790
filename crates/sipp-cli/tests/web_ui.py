"""The chat page and the dashboard in headless Chromium against a real
`sipp serve` (driven by tests/serve_web.rs).

Usage: web_ui.py BASE_URL ADMIN_KEY USER_KEY MODEL SCREENSHOT_DIR

Chat: the page asks for the key, takes it, lists the models, streams an
answer that visibly grows, stops it (the server's slot frees in /metrics),
shows per-answer stats, keeps the conversation across a reload, sanitizes
model markdown, and fits 360 px. Dashboard: the admin key shows a busy slot
during a request; a user key is refused. No console errors beyond the
expected refusals. Prints figures, then `ok`.
"""

import json
import os
import sys
import threading
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

BASE, ADMIN, USER, MODEL, SHOTS = sys.argv[1:6]
os.makedirs(SHOTS, exist_ok=True)


def metric(name):
    req = urllib.request.Request(BASE + "/metrics", headers={"Authorization": "Bearer " + ADMIN})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    prefix = name + '{model="' + MODEL + '"}'
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{prefix} not in /metrics")


def eventually(what, f, timeout=60, every=0.1):
    end = time.time() + timeout
    while time.time() < end:
        v = f()
        if v:
            return v
        time.sleep(every)
    raise AssertionError("timed out waiting for: " + what)


def driver():
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"]:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


d = driver()
wait = WebDriverWait(d, 60)
by_id = lambda i: d.find_element(By.ID, i)


def console_errors(allowed=()):
    """SEVERE browser log entries, minus those naming an allowed status."""
    bad = []
    for e in d.get_log("browser"):
        if e["level"] != "SEVERE":
            continue
        if any(a in e["message"] for a in allowed):
            continue
        bad.append(e["message"])
    return bad


def answers():
    return d.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")


def send(text, max_tokens):
    m = by_id("max-tokens")
    m.clear()
    m.send_keys(str(max_tokens))
    box = by_id("input")
    box.send_keys(text)
    by_id("send").click()


try:
    # --- first load: the key is asked for --------------------------------
    d.get(BASE + "/")
    nav = d.execute_script("const n = performance.getEntriesByType('navigation')[0]; return {load: n.loadEventEnd - n.startTime, dcl: n.domContentLoadedEventEnd - n.startTime};")
    wait.until(lambda _: by_id("notice").is_displayed() and "API key" in by_id("notice").text)
    # The only console errors so far are the refused /v1/models (401).
    errs = console_errors(allowed=("401",))
    assert not errs, errs
    resources = d.execute_script("return performance.getEntriesByType('resource').filter(r => r.name.includes('/ui/')).map(r => [r.name, r.decodedBodySize]);")
    page_bytes = sum(size for _, size in resources)
    by_id("api-key").send_keys(ADMIN)
    by_id("save-key").click()
    wait.until(lambda _: len(by_id("model").find_elements(By.TAG_NAME, "option")) > 0)
    assert by_id("model").get_attribute("value") == MODEL, by_id("model").get_attribute("value")
    assert not by_id("notice").is_displayed()
    wait.until(lambda _: not by_id("settings").is_displayed())
    by_id("settings-toggle").click()

    # --- a streamed answer grows, then stop frees the server's slot ------
    send("Write a very long story about a lighthouse keeper and the sea, with many chapters.", 1000)
    wait.until(lambda _: answers() and len(answers()[-1].text) > 0)
    first = len(answers()[-1].text)
    grown = eventually("the answer to grow", lambda: len(answers()[-1].text) > first + 10 and len(answers()[-1].text), timeout=30)
    assert by_id("stop").is_displayed()
    assert metric("sipp_busy_slots") == 1
    by_id("stop").click()
    eventually("the slot to free after stop", lambda: metric("sipp_busy_slots") == 0, timeout=10)
    wait.until(lambda _: by_id("send").is_displayed())
    stopped_text = answers()[-1].text
    assert len(stopped_text) >= grown, (len(stopped_text), grown)
    stats = d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[-1].text
    assert "stopped" in stats and "TTFT" in stats, stats

    # --- a short answer that ends by itself, with its stats ---------------
    send("Say hello.", 24)
    wait.until(lambda _: len(answers()) == 2 and by_id("send").is_displayed())
    stats2 = d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")[-1].text
    assert "TTFT" in stats2 and "tokens" in stats2 and "cached" in stats2, stats2
    assert "stopped" not in stats2, stats2
    d.save_screenshot(os.path.join(SHOTS, "chat.png"))

    # --- reload: the conversation is still there --------------------------
    d.refresh()
    wait.until(lambda _: len(d.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2)
    users = [e.text for e in d.find_elements(By.CSS_SELECTOR, ".msg.user .content")]
    assert users[0].startswith("Write a very long story"), users
    assert answers()[0].text == stopped_text
    titles = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#conversations .open")]
    assert any(t.startswith("Write a very long story") for t in titles), titles

    # --- 360 px wide -------------------------------------------------------
    d.set_window_size(360, 740)
    d.refresh()
    wait.until(lambda _: len(d.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2)
    width = d.execute_script("return document.documentElement.scrollWidth;")
    inner = d.execute_script("return window.innerWidth;")
    assert width <= inner, (width, inner)
    assert by_id("send").is_displayed() and by_id("input").size["width"] > 100
    assert not by_id("sidebar").is_displayed() or by_id("sidebar").location["x"] < 0
    d.save_screenshot(os.path.join(SHOTS, "chat-360.png"))
    by_id("menu").click()
    wait.until(lambda _: by_id("sidebar").location["x"] >= 0)
    d.save_screenshot(os.path.join(SHOTS, "chat-360-menu.png"))
    d.set_window_size(1280, 900)
    errs = console_errors()
    assert not errs, errs

    # --- dashboard: the saved admin key shows a busy slot -----------------
    d.get(BASE + "/dashboard")
    wait.until(lambda _: by_id("status").text == "live")
    wait.until(lambda _: d.find_elements(By.CSS_SELECTOR, f'.target[data-target="{MODEL}"] .slot'))
    assert not d.find_elements(By.CSS_SELECTOR, f'.target[data-target="{MODEL}"] .slot:not([data-phase="Idle"])')

    seen_busy = threading.Event()

    def background():
        # ignore_eos: the slot stays busy for all 400 tokens whatever the
        # model writes. The dashboard samples once a second and a fast
        # machine decodes 400 tokens in about that, so requests follow one
        # another until the test has seen the slot busy.
        body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
        while not seen_busy.is_set():
            req = urllib.request.Request(BASE + "/v1/completions", data=body, headers={"Authorization": "Bearer " + ADMIN, "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                while r.read(256):
                    pass

    t = threading.Thread(target=background, daemon=True)
    t.start()
    busy = eventually(
        "a busy slot on the dashboard",
        lambda: d.find_elements(By.CSS_SELECTOR, f'.target[data-target="{MODEL}"] .slot:not([data-phase="Idle"])'),
        timeout=60,
    )
    phase = busy[0].get_attribute("data-phase")
    assert phase in ("Admitted", "Prefill", "Decode", "EmitBuffered"), phase
    busy_text = d.find_element(By.CSS_SELECTOR, f'.target[data-target="{MODEL}"] dd.busy').text
    assert busy_text.startswith("1 /"), busy_text
    d.save_screenshot(os.path.join(SHOTS, "dashboard.png"))
    seen_busy.set()
    t.join(timeout=120)
    assert not t.is_alive(), "the background requests did not finish"
    # The finished requests show among the recent ones (the short chat
    # answer and this one; the stopped stream's client left before its end).
    wait.until(lambda _: len(d.find_elements(By.CSS_SELECTOR, "#recent tbody tr")) >= 2)
    errs = console_errors()
    assert not errs, errs

    # --- a user key is refused the dashboard's data ------------------------
    key = by_id("api-key")
    key.clear()
    key.send_keys(USER)
    by_id("connect").click()
    wait.until(lambda _: "403" in by_id("status").text)
    assert "admin" in by_id("status").text, by_id("status").text
    errs = console_errors(allowed=("403",))
    assert not errs, errs

    # --- model output is sanitized ----------------------------------------
    d.get(BASE + "/")
    wait.until(lambda _: d.execute_script("return typeof window.sippRender === 'function';"))
    html = d.execute_script(
        "return window.sippRender('**bold** <img src=x onerror=\"window.pwned=1\"> <script>window.pwned=2</script> [x](javascript:alert(1)) <a href=\"https://example.com\">l</a> <span style=\"color:red\">s</span>\\n\\n```\\ncode <b>\\n```');"
    )
    assert "<strong>bold</strong>" in html, html
    for bad in ["onerror", "<script", "javascript:", "style="]:
        assert bad not in html, (bad, html)
    assert "<pre><code>" in html and "&lt;b&gt;" in html, html
    assert 'rel="noopener noreferrer"' in html, html
    assert d.execute_script("return window.pwned === undefined;")
    # The probe's only console output is the page's CSP refusing what the
    # parser met (DOMPurify parses the dirty HTML before removing it).
    errs = console_errors(allowed=("Content Security Policy",))
    assert not errs, errs

    print(f"first load of / : {nav['load']:.0f} ms to load event ({nav['dcl']:.0f} ms to DOMContentLoaded); page assets {page_bytes} bytes over {len(resources)} files")
    print(f"stream grew from {first} to {grown} characters before stop; screenshots in {SHOTS}")
    print("ok")
finally:
    d.quit()
