"""What of a location and its storage options is never shown: credentials.

An error message may quote a URL (with a ``user:password@`` part) or, through a client, an
option's value. :func:`redacted` replaces both before a message is printed (``dmuon-ckpt``
does it for every failure it reports).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = ["SECRET_OPTION_WORDS", "redacted", "secret_values"]

#: an option whose name holds one of these is a secret (s3fs's ``key``/``secret``/``token``,
#: gcsfs's ``token``, botocore's ``aws_secret_access_key``, Azure's ``account_key``, ...)
SECRET_OPTION_WORDS = ("key", "secret", "token", "password", "credential", "auth", "signature")
_MASK = "***"
_SHORTEST_SECRET = 4  # shorter values ("1", "us") would mask ordinary words
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def secret_values(options: object, secret: bool = False) -> Iterator[str]:
    """The string values of ``options`` (nested dicts and lists too) held under a secret's name."""
    if isinstance(options, dict):
        for name, value in options.items():
            yield from secret_values(value, secret or any(w in str(name).lower() for w in SECRET_OPTION_WORDS))
    elif isinstance(options, (list, tuple)):
        for value in options:
            yield from secret_values(value, secret)
    elif secret and isinstance(options, str) and len(options) >= _SHORTEST_SECRET:
        yield options


def redacted(text: str, *options: dict | None) -> str:
    """``text`` without the secrets among ``options``' values and without the user and password
    part of any URL in it."""
    for value in sorted({v for o in options for v in secret_values(o)}, key=len, reverse=True):
        text = text.replace(value, _MASK)
    return _USERINFO.sub(lambda m: f"{m['scheme']}{_MASK}@", text)
