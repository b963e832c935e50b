"""The registry's HTTP, bounded: connect and read timeouts on every request, a deadline per
command, and no blind retries (oras retries any exception five times over two minutes)."""
from __future__ import annotations

import time
import urllib.parse

import oras.provider
import requests
from requests.adapters import HTTPAdapter

from .. import config
from ..errors import StoreError


class Deadline(HTTPAdapter):
    """Every request to the registry gets connect and read timeouts, and none starts past the
    command's overall deadline: a registry that stalls cannot hang a push or pull."""

    def __init__(self, host: str, timeout_s: float, deadline_s: float):
        super().__init__()
        self.host, self.timeout, self.deadline = host, timeout_s, time.monotonic() + deadline_s

    def send(self, request, **kwargs):
        if time.monotonic() > self.deadline:
            raise StoreError(f"registry {self.host}: the command's deadline "
                             f"({config.registry_deadline_s():.0f} s, DEEPJIT_REGISTRY_DEADLINE_S) passed")
        kwargs["timeout"] = kwargs.get("timeout") or (self.timeout, self.timeout)
        try:
            return super().send(request, **kwargs)
        except requests.Timeout:
            raise StoreError(f"registry {self.host} did not answer within {self.timeout:.0f} s "
                             f"({request.method} {urllib.parse.urlsplit(request.url).path}; "
                             "DEEPJIT_REGISTRY_TIMEOUT_S sets the limit)") from None


class RegistrySession(oras.provider.Registry):
    """oras's Registry without its retry on any exception (sleeps of 3 to 83 s between five tries): a
    timeout or the deadline must end the command at once; an HTTP 500 gets two quick retries here."""

    def do_request(self, *args, **kwargs):
        for attempt in range(3):
            response = _UNRETRIED_REQUEST(self, *args, **kwargs)
            if response.status_code != 500 or attempt == 2:
                return response
            time.sleep(0.2 * 2 ** attempt)


_UNRETRIED_REQUEST = oras.provider.Registry.do_request.__wrapped__
