"""Azure Blob Storage on loopback for the tests: Azurite (`azurite-blob`, from npm: `npm install -g
azurite`) on a free port, with its well-known development account's shared key, stopped at the
end (`bench.stores.serve`, as the S3 servers are)."""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import hmac
import shutil
import urllib.request
from pathlib import Path

from bench.stores import serve

AZURE_ACCOUNT = "devstoreaccount1"  # Azurite's development account and its published key
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@contextlib.contextmanager
def azure_server(work: Path, containers: tuple[str, ...] = ("mmpack",)):
    """Yields the blob endpoint URL of a running Azurite with `containers` made."""
    azurite = shutil.which("azurite-blob")
    if azurite is None:
        raise RuntimeError("no `azurite-blob`: npm install -g azurite")
    with contextlib.ExitStack() as running:
        port, = serve(running, 1, lambda free: (
            [azurite, "--blobHost", "127.0.0.1", "--blobPort", str(free[0]), "--location", str(work), "--silent",
             "--skipApiVersionCheck", "--loose"], free[0], work / "azurite.log", {}))
        endpoint = f"http://127.0.0.1:{port}/{AZURE_ACCOUNT}"
        for name in containers:
            _create_container(endpoint, name)
        yield endpoint


def _create_container(endpoint: str, name: str) -> None:
    """PUT ?restype=container, signed with the account's shared key (the client makes no containers)."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")
    headers = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
    signed = "PUT" + "\n" * 12 + "".join(f"{k}:{v}\n" for k, v in sorted(headers.items())) + \
        f"/{AZURE_ACCOUNT}/{AZURE_ACCOUNT}/{name}\nrestype:container"
    mac = hmac.new(base64.b64decode(AZURE_KEY), signed.encode(), hashlib.sha256).digest()
    request = urllib.request.Request(f"{endpoint}/{name}?restype=container", method="PUT", headers={
        **headers, "Authorization": f"SharedKey {AZURE_ACCOUNT}:{base64.b64encode(mac).decode()}", "Content-Length": "0"})
    urllib.request.urlopen(request, timeout=30).close()
