"""The download helper's side (`python -m packer.remote.helper`): a fresh interpreter that makes
the requests of a process forked after its parent used the client (`packer.remote.client.Helper`
starts it and writes to it), one JSON line in and one out per request."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from packer.dataset import format as fmt
from packer.errors import ConfigError, IntegrityError
from packer.remote import client, transfer
from packer.remote.url import Remote


def _answer(request: dict, stores: dict) -> dict:
    if request["op"] == "manifest":
        name, text = transfer.read_pointer(Remote(request["url"]))
        return {"name": name, "text": text}
    url = request["url"]
    if url not in stores:
        stores[url] = client.store(Remote(url))
    if request["op"] == "range":
        return {"fits": transfer.get_range(lambda: stores[url], url, request["path"], request["start"], request["end"],
                                           Path(request["target"]))}
    if request["op"] == "small":
        got = transfer.get_small(lambda: stores[url], url, request["path"], request["size"])
        return {"hex": None if got is None else got.hex()}
    doc = request["entry"]
    entry = fmt.FileEntry(doc["path"], doc["size_bytes"], doc["checksum"]["hex"], doc["checksum"]["algo"])
    temp = open(request["temp"], "r+b") if request["temp"] else None
    try:
        packed = fmt.ArchiveFile(**request["packed"]) if request.get("packed") else None
        gets = transfer.fetch_file(lambda: stores[url], url, entry, Path(request["target"]), temp, packed)
    finally:
        if temp is not None:
            temp.close()
    return {"gets": gets}


def serve() -> None:
    stores: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = _answer(request, stores)
        except (ConfigError, IntegrityError) as exc:
            reply = {"error": type(exc).__name__, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - sent back as one line
            reply = {"error": "ConfigError", "message": f"{request.get('url')}: {type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
