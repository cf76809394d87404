"""The example tool: a key/value look-up over the JSON file named by ``LOOKUP_DATA_FILE``.

Enable it with ``TOOLS=service.tools.lookup:lookup``. The file is a JSON object of string
keys to string values, read and checked on first use and kept for the life of the process
(per path, so a different ``LOOKUP_DATA_FILE`` is read anew). A missing or malformed file
raises on use, so the call is a ``TOOL_ERROR`` and the operator finds the reason in the log;
it is read again on the next call, so fixing the file needs no restart.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from service.core.strictjson import StrictJSONError, loads

ENV = "LOOKUP_DATA_FILE"


class LookupTool:
    name = "lookup"
    description = (
        "Look up the value stored under an exact key in the operator's reference data. "
        "Returns the value, or status NOT_FOUND when there is no such key."
    )

    def __init__(self, data_file: str | Path | None = None) -> None:
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {"key": {"type": "string", "minLength": 1, "maxLength": 256}},
            "required": ["key"],
            "additionalProperties": False,
        }
        self._data_file = data_file  # None: the path comes from the environment, at use
        self._lock = threading.Lock()  # several workers may make the first call at once
        self._loaded: tuple[Path, dict[str, str]] | None = None

    def run(self, arguments: dict[str, Any]) -> str | None:
        return self._table().get(arguments["key"])

    def _table(self) -> dict[str, str]:
        path = self._path()
        with self._lock:
            if self._loaded is None or self._loaded[0] != path:
                self._loaded = path, _read(path)
            return self._loaded[1]

    def _path(self) -> Path:
        configured = self._data_file or os.environ.get(ENV)
        if not configured:
            raise RuntimeError(f"{ENV} is not set")
        return Path(configured)


def _read(path: Path) -> dict[str, str]:
    try:
        data = loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, StrictJSONError) as exc:
        raise RuntimeError(f"{ENV} {path}: cannot read a JSON document: {exc}") from exc
    if not isinstance(data, dict):
        raise RuntimeError(f"{ENV} {path}: not a JSON object")
    wrong = next((key for key, value in data.items() if not isinstance(value, str)), None)
    if wrong is not None:
        raise RuntimeError(f"{ENV} {path}: the value of {wrong!r} is not a string")
    return data


lookup = LookupTool()
