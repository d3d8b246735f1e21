"""A real Elasticsearch-API server for tests: osmem-server (PyPI), started and stopped by the test.

osmem-server speaks the Elasticsearch REST API but answers 406 to the official client's
compatibility mimetype. elasticsearch-py 9.x rewrites Accept and Content-Type in
BaseClient._perform_request, *after* merging the client's and the request's headers, from
application/json to "application/vnd.elasticsearch+json; compatible-with=9" (and x-ndjson alike,
for _bulk). So a per-client `headers={...}` override is rewritten too; only the serverless flag
skips it. What works is one layer down: a transport node class that turns the compatibility
mimetype back into plain application/json just before the request is sent, passed via
`client_options={"node_class": PlainJsonNode}`. This is a test-only transport; the production
adapter keeps the client's headers untouched (a test checks osmem refuses the unmodified one).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from conftest import LOOPBACK, find_free_port, wait_until
from elastic_transport import Urllib3HttpNode

_COMPAT_MIMETYPE = re.compile(r"application/vnd\.elasticsearch\+([\w-]+); compatible-with=\d+")


class PlainJsonNode(Urllib3HttpNode):
    def perform_request(self, method, target, body=None, headers=None, **kwargs):
        if headers:
            headers = headers.copy()
            for name in ("accept", "content-type"):
                if name in headers:
                    headers[name] = _COMPAT_MIMETYPE.sub(r"application/\1", headers[name])
        return super().perform_request(method, target, body=body, headers=headers, **kwargs)


CLIENT_OPTIONS = {"node_class": PlainJsonNode}


@contextlib.contextmanager
def osmem_server(handle: list | None = None) -> Iterator[str]:
    """Run osmem-server on a free loopback port; yields its URL. ``handle`` receives the server."""
    from osmem_server import OsmemServer

    server = OsmemServer.start(addr=f"{LOOPBACK}:{find_free_port()}", japanese=False)
    if handle is not None:
        handle.append(server)
    try:
        wait_until(
            lambda: server.request("GET", "/_cluster/health")["status"] in ("green", "yellow"),
            timeout=15,
            message="osmem-server health",
        )
        yield server.url
    finally:
        server.close()
        assert server.process.poll() is not None
