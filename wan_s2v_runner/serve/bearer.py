"""Where a server's (and its clients') bearer token comes from: ``--token-file FILE`` (its first
line; the file should be the user's alone), else ``--token``, else ``$WAN_S2V_TOKEN``. Prefer the
file or the environment: a ``--token`` on the command line is visible to every user of the
machine (``ps``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

TOKEN_ENV = "WAN_S2V_TOKEN"


class TokenError(ValueError):
    """The token file cannot be used (one line: cause and fix)."""


def read_token_file(path: Path) -> str:
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"cannot read the token file {path} ({e}). Fix: pass a readable file whose first "
                         "line is the token") from None
    token = (text.splitlines() or [""])[0].strip()
    if not token:
        raise TokenError(f"the token file {path} is empty. Fix: write the token on its first line")
    return token


def token_of(args) -> Optional[str]:
    """The token the command's options and environment give (None: none); raises :class:`TokenError`."""
    path = getattr(args, "token_file", None)
    if path is not None:
        return read_token_file(path)
    return getattr(args, "token", None) or os.environ.get(TOKEN_ENV) or None
