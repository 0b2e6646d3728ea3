"""What every object over a library handle shares: closing it once, from any of close(), a
``with`` block or garbage collection."""

from __future__ import annotations

import threading
from typing import Any, Optional

from . import _lib


class Handle:
    """Owns one library handle, released by the C function named ``_DESTROY``."""

    _DESTROY: str

    def __init__(self, handle: int):
        self._handle: Optional[int] = handle
        self._close_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _release(self) -> None:
        # The lock makes close() idempotent under races: exactly one caller gets the handle.
        with self._close_lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            _lib.check(getattr(_lib.lib(), self._DESTROY)(handle))

    def close(self) -> None:
        self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # A dropped object still releases its handle. Errors are dropped: raising from
        # __del__ only prints, and at interpreter exit the modules may be gone.
        try:
            if getattr(self, "_handle", None) is not None:
                self.close()
        except Exception:
            pass
