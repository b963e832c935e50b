"""Where a registry's credentials may go: only to requests whose origin (scheme, host, port) is the
registry's own, or its token realm's when the registry's /v2/ answer puts that on the same host.
Everything else (a blob redirect to storage, an upload Location, a realm a later challenge names)
is still sent, but without an Authorization header."""
from __future__ import annotations

import logging
import urllib.parse

from .http import Deadline

log = logging.getLogger("deepjit.store")

Origin = tuple[str, str, int]
_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(url: str) -> Origin | None:
    """(scheme, host, port) of a URL, the default port filled in; None if the URL has no valid port."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    return scheme, parts.hostname or "", _DEFAULT_PORTS.get(scheme, 0) if port is None else port


def show(o: Origin | None) -> str:
    return f"{o[0]}://{o[1]}:{o[2]}" if o else "an unparsable URL"


def realm_url(challenge: str, scheme: str) -> str | None:
    """A Bearer challenge's token realm as oras will request it: it prefixes a realm that has no
    scheme with the registry's, so the host must be judged on that URL, not on the raw value."""
    for part in challenge.split(","):
        key, _, value = part.strip().partition("=")
        if key.lower().endswith("realm"):
            url = value.strip().strip('"')
            return url if url.startswith("http") else f"{scheme}://{url}"
    return None


class PinnedCredentials(Deadline):
    """The transport under every request of a store's session: its own, oras's token requests and
    each hop of a redirect all pass here, so this is the one place that sees every final URL. An
    Authorization header (set by requests, oras or a netrc) leaves only for a trusted origin."""

    def __init__(self, host: str, timeout_s: float, deadline_s: float, origins: frozenset[Origin]):
        super().__init__(host, timeout_s, deadline_s)
        self.origins = origins

    def send(self, request, **kwargs):
        target = origin(request.url)
        if target not in self.origins and request.headers.pop("Authorization", None) is not None:
            log.debug("registry %s: no credentials sent to %s", self.host, show(target))
        return super().send(request, **kwargs)
