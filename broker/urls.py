"""``--broker`` settings without Redis: the URL's check and its redacted form, for settings,
stats and logs (this module imports no redis, so a server without a broker never loads it)."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from settings.server_config import ServerConfig

#: URL schemes redis-py connects with.
SCHEMES = ("redis", "rediss", "unix")


def check_url(url: str) -> str | None:
    """What is wrong with a ``--broker`` URL, or None."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        return f"--broker must be a redis://, rediss:// or unix:// URL, got {redact(url)!r}"
    return None


def redact(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def config_problems(config: ServerConfig) -> list[str]:
    """What is wrong with the config's ``--broker`` URL (the settings' check of it, given to
    settings/ through its registry); empty without a broker."""
    if config.broker is None:
        return []
    problem = check_url(config.broker)
    return [problem] if problem else []
