"""Small networking helpers: free ports, host addresses."""

from __future__ import annotations

import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if a server could listen on ``port`` now. SO_REUSEADDR, as servers set it, so sockets
    lingering in TIME_WAIT after a clean shutdown do not count as taken; a live listener does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def local_ip() -> str:
    """This host's outward-facing IP (no packet is sent), or 127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
