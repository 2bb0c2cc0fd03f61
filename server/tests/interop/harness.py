"""What the interoperability scripts share: a tally of named checks, and tollgate-server started
on a configuration directory with the memory store."""

import os
import re
import signal
import subprocess
import sys


class Tally:
    """Named checks: each prints `ok` or `FAILED`; `exit` reports and exits 1 on any failure."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def check(self, name, got, want):
        if got == want:
            self.passed += 1
            print(f"ok {name}")
        else:
            self.failed += 1
            print(f"FAILED {name}: got {got!r}, want {want!r}")

    def exit(self):
        print(f"{self.passed} passed, {self.failed} failed")
        sys.exit(1 if self.failed else 0)


def start(binary, config_dir):
    """Starts `binary` on a free loopback port serving `config_dir` (no REDIS* variables: the
    memory store); returns the process and the address its one line says it serves on."""
    server = subprocess.Popen(
        [binary, "--config", config_dir, "--listen", "127.0.0.1:0", "--grace", "200ms"],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("REDIS")},
    )
    line = server.stdout.readline()
    match = re.search(r"serving ShouldRateLimit on (\S+)", line)
    if not match:
        server.kill()
        raise SystemExit(f"the server did not say where it serves: {line!r}")
    return server, match.group(1)


def stop(process):
    """Sends SIGTERM and returns the exit status."""
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=30)
