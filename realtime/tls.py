"""TLS for the gateway's one port (`server.tls_cert`, `server.tls_key`): https:// and wss://."""

from __future__ import annotations

import ssl
from pathlib import Path

from realtime.config import ServerSection


def server_context(server: ServerSection) -> ssl.SSLContext | None:
    """The server's TLS context, or None without TLS. ValueError naming the file and what is wrong with it,
    so `duplex serve` says so before the engine starts."""
    if server.tls_cert is None and server.tls_key is None:
        return None
    if server.tls_cert is None or server.tls_key is None:
        raise ValueError("config keys 'server.tls_cert' and 'server.tls_key' (--tls-cert, --tls-key) go together: give both")
    for key, path in (("server.tls_cert", server.tls_cert), ("server.tls_key", server.tls_key)):
        if not Path(path).is_file():
            raise ValueError(f"config key '{key}': no such file: {path}")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(server.tls_cert, server.tls_key)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"TLS: cannot use certificate {server.tls_cert} with key {server.tls_key}: {e}") from None
    return context


def base_url(server: ServerSection, port: int) -> str:
    """How clients reach this server: `server.public_url`, else http(s)://host:port."""
    scheme = "https" if server.tls_cert else "http"
    return server.public_url or f"{scheme}://{server.host}:{port}"
