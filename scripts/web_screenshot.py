"""The README's screenshot of the web page: ``python scripts/web_screenshot.py URL OUT.png``.

Against a running ``forerun serve`` at URL (the default model): asks one question at
temperature 0 in headless Chromium (Debian's ``chromium`` and ``chromedriver``), then puts
four streams of load on the server and takes the page four seconds later.
"""

from __future__ import annotations

import sys
import threading
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By


def main(url: str, out: str) -> None:
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,640", "--hide-scrollbars"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    done = threading.Event()

    def stream(i: int) -> None:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0.8, "seed": i, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    break  # closing the stream aborts the request

    load = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    try:
        driver.get(f"{url}/")
        for field, value in (("temperature", "0"), ("max-tokens", "60")):
            box = driver.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        driver.find_element(By.ID, "prompt").send_keys(
            "What is the capital of France? Tell me about it.\n")
        time.sleep(0.5)
        while driver.execute_script("return window.forerun.chat.streaming"):
            time.sleep(0.1)
        for t in load:
            t.start()
        time.sleep(4)
        driver.save_screenshot(out)
    finally:
        done.set()
        for t in load:
            if t.is_alive():
                t.join()
        driver.quit()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
