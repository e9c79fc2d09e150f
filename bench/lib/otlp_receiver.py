"""OtlpReceiver: an OTLP/HTTP (protobuf) trace receiver on a free loopback port, in a thread of
its own, that keeps each export request's body as it comes and decodes nothing (decoding beside
a client's reads would hold the process's GIL while it waits for a token); the TTFT breakdown
bench and the tests' span sink decode them later. Owns its HTTP server and the bodies."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TRACES_PATH = "/v1/traces"  # where an OTLP/HTTP exporter posts spans


class OtlpReceiver:
    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        answer = ExportTraceServiceResponse().SerializeToString()
        self._bodies: list[bytes] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._lock:  # kept whatever the path, answered 404 off TRACES_PATH
                    receiver._bodies.append(body)
                self.send_response(200 if self.path == TRACES_PATH else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def bodies(self, start: int = 0) -> list[bytes]:
        """The export requests' bodies received so far, from the start-th on."""
        with self._lock:
            return self._bodies[start:]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def any_value(value: Any) -> Any:
    """An OTLP AnyValue's Python value (None when it holds none)."""
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)
