"""A real headless Chromium for tests that look at a page as a person would (Selenium WebDriver on
Debian's ``chromium`` and ``chromium-driver``).

``chromium()`` finds the browser and its driver; where they are missing and the test runs as root
on a machine with apt, it installs them (``apt-get install chromium chromium-driver``, after one
``apt-get update``), so a fresh clone's ``make test`` brings them itself. Where nothing can be
installed (not root, no apt, no network to the package mirror, no ``selenium`` package) the test
is skipped with a message that says which, never passed.

Chromium as root needs ``--no-sandbox``; the other switches keep it from reaching the network on
its own (updates, sync, QUIC) and give every run a fresh profile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

PACKAGES = ("chromium", "chromium-driver")
SWITCHES = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", "--window-size=1600,1000")
INSTALL_TIMEOUT_S = 600


def _found() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def _install() -> str | None:
    """Install Debian's Chromium and its driver; None when done, else why not."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    if os.geteuid() != 0:
        return "not root: apt-get install chromium chromium-driver by hand"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"],
                    ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=INSTALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"{' '.join(command[:2])} did not finish in {INSTALL_TIMEOUT_S} s"
        if done.returncode != 0:
            return f"{' '.join(command[:2])} failed: {done.stderr.strip()[-300:]}"
    return None


def browser_paths() -> tuple[str, str]:
    """Chromium's and chromedriver's paths, installing them if need be; skips when it cannot."""
    found = _found()
    if found is None:
        why = _install()
        found = _found()
        if found is None:
            pytest.skip(f"no headless Chromium for the browser test ({why or 'installed, not found'})")
    return found


@contextmanager
def chromium() -> Iterator[Any]:
    """A Selenium WebDriver on a fresh headless Chromium; quit on the way out."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("the selenium package is missing (pip install -e '.[dev]')")
    browser, driver_path = browser_paths()
    profile = tempfile.mkdtemp(prefix="fleet-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for switch in (*SWITCHES, f"--user-data-dir={profile}"):
        options.add_argument(switch)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
