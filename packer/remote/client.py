"""The object-store client of this process (obstore, the Rust object_store), its errors as our
one-line errors, and the helper process that makes requests for a process forked after one.

Credentials and endpoint are the standard environment: for s3://, AWS_ENDPOINT_URL (or
AWS_ENDPOINT_URL_S3), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_REGION / AWS_DEFAULT_REGION, or else a profile (AWS_PROFILE, ~/.aws/credentials, read again
as it changes: `credentials`), web identity, container or instance metadata; for az://, the client's AZURE_* variables (AZURE_STORAGE_ACCOUNT_NAME
with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, a managed identity or the Azure CLI;
AZURE_STORAGE_ENDPOINT and AZURE_ALLOW_HTTP for an emulator). A client is made lazily in the
process that uses it, never inherited by a fork.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta

from packer.errors import ConfigError, IntegrityError
from packer.remote import credentials, pace
from packer.remote.url import CREDENTIALS, Remote

# How long a request is tried again, from its first try, before it is an error: a store that
# restarts, or throttles, for a minute is ridden out. MMPACK_REMOTE_DEADLINE (seconds) sets it.
DEADLINE_S = 120.0
# A connection that answers nothing for this long is broken (tried again within the deadline),
# whatever the size of the answer: a stalled stream is found in seconds, a slow one never is
READ_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0

# obstore's runtime (tokio) is not fork-safe: a process forked after its parent made a request
# hangs on its first own request, whatever client it makes. Such a process (a forked DataLoader
# worker) hands its requests to a helper it starts with exec (`Helper`), a fresh interpreter.
_used = False  # this process has made a request
_forked_after_use = False  # an ancestor had, before it forked this process


def _after_fork() -> None:
    global _forked_after_use
    _forked_after_use = _forked_after_use or _used


os.register_at_fork(after_in_child=_after_fork)


def fork_safe() -> bool:
    """Whether this process may use obstore itself (it was not forked from one that had)."""
    return not _forked_after_use


def obstore(remote: Remote):
    """The client library, or one line saying how to install it."""
    try:
        import obstore as obs
    except ImportError:
        raise ConfigError(f"{remote.url}: {remote.scheme} datasets need obstore: "
                          "pip install 'mmpack[remote]'") from None
    return obs


def store(remote: Remote):
    """A client for `remote`'s bucket, made in this process."""
    global _used
    _used = True
    obstore(remote)
    from obstore.store import AzureStore, S3Store

    options = {"retry_config": retry_config(), "client_options": client_options()}
    if remote.scheme == "az://":  # account, key or token, endpoint: the client's AZURE_* environment
        # our client_options replace the ones the client reads from the environment, its
        # AZURE_ALLOW_HTTP among them: an emulator's http:// endpoint is refused ("BadScheme") unless said again
        endpoint = os.environ.get("AZURE_STORAGE_ENDPOINT") or os.environ.get("AZURE_ENDPOINT") or ""
        if endpoint.startswith("http://") or os.environ.get("AZURE_ALLOW_HTTP", "").lower() in ("1", "true", "yes"):
            options["client_options"] = {**options["client_options"], "allow_http": True}
        return _made(AzureStore, remote.bucket, **options)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    profile = credentials.profile_provider()  # keys from a profile, read again as its file changes
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or \
        (credentials.profile_region() if profile else None) or "us-east-1"
    extra = {"endpoint": endpoint, "allow_http": endpoint.startswith("http://"),
             "virtual_hosted_style_request": False} if endpoint else {}
    if profile is not None:
        extra["credential_provider"] = profile
    return _made(S3Store, remote.bucket, region=region, **options, **extra)


def deadline_s() -> float:
    """MMPACK_REMOTE_DEADLINE, else DEADLINE_S; a value that is no positive number is one line."""
    return pace.setting("MMPACK_REMOTE_DEADLINE", DEADLINE_S, "the seconds a request may be tried again, e.g. 120")


def retry_config() -> dict:
    """One try a call: every request is tried again by `request` (`pace`), which sees the
    answers the client's own retries hid (a 503 SlowDown) and paces the requests by them."""
    return {"max_retries": 0}


def request(make):
    """`make()`, one request to a store, paced with this process's others and tried again after
    refused or reset connections, timeouts, 5xx and throttling until the deadline (not a count:
    ten quick refusals were over in 5 s, inside any restart), so a store back after a minute is
    found within seconds: `pace`. An answer that the keys expired is tried again where the keys
    are read again (`credentials.renewable`)."""
    return pace.pace().call(make, deadline_s=deadline_s(), renewable=credentials.renewable())


def get(obs, store, key: str, **options):
    """obstore's GET of `key` (a stream of its bytes once the answer's head is in), as `request`
    makes it: the head tried again, not the body (`read` reads both)."""
    return request(lambda: obs.get(store, key, **options))


def read(obs, store, key: str, consume, **options):
    """obstore's GET of `key` and `consume(stream)` of its body as one try, made again from its
    start (`consume` begins anew: its sink's state is its own to reset) when the body is cut off
    after the head (a connection closed, reset or silent mid-way), as a refused request is, until
    the deadline: one cut body ended a run that the head's retries would have ridden out.
    `consume`'s result."""
    return request(lambda: consume(obs.get(store, key, **options)))


def put(obs, store, key: str, data, **options):
    """obstore's PUT of `data` (bytes, or a file sent from its start each try), as `request` makes it."""
    def once():
        if hasattr(data, "seek"):
            data.seek(0)
        return obs.put(store, key, data, **options)
    return request(once)


def client_options() -> dict:
    """Connect within CONNECT_TIMEOUT_S, and an answer silent for READ_TIMEOUT_S is broken; no
    bound on a whole answer (the client's default, 30 s, failed every try of a shard whose
    download takes longer, on any link slower than its size over 30 s)."""
    return {"connect_timeout": timedelta(seconds=CONNECT_TIMEOUT_S), "read_timeout": timedelta(seconds=READ_TIMEOUT_S),
            "timeout": timedelta(days=1)}


def _made(kind, *args, **options):
    try:
        return kind(*args, **options)
    except ValueError as exc:  # an obstore from before read_timeout: a whole answer's bound, generous
        if "read_timeout" not in str(exc):
            raise
        client = {**options["client_options"], "timeout": timedelta(minutes=5)}
        del client["read_timeout"]
        return kind(*args, **{**options, "client_options": client})


def errors(remote: Remote, what: str):
    """Runs `what` against the store; its errors as our one-line errors naming the URL."""

    class Guard:
        def __enter__(self):
            return self

        def __exit__(self, kind, exc, tb):
            if exc is None or isinstance(exc, (ConfigError, IntegrityError)):
                return False
            name = type(exc).__name__
            text = str(exc).splitlines()[0].split(": <?xml")[0][:200] if str(exc) else name  # (no XML of the store)
            if not_found(exc):
                raise IntegrityError(f"{remote.url}: {what}: not found ({text})") from None
            if pace.kind_of(exc) == "expired":
                raise ConfigError(f"{remote.url}: {what}: the store says the keys expired ({expired_code(exc)}); "
                                  f"{credentials.expired_advice(deadline_s())}") from None
            if "error sending request" in str(exc) or "Connection refused" in str(exc):
                raise ConfigError(f"{remote.url}: {what}: the store did not answer; check its endpoint and that it is "
                                  f"up ({text})") from None
            if "PermissionDenied" in name or "Unauthenticated" in name or any(
                    s in text for s in ("403", "Forbidden", "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId")):
                raise ConfigError(f"{remote.url}: {what}: access denied; {CREDENTIALS[remote.scheme]}") from None
            if isinstance(exc, OSError) or "Generic" in name or "Error" in name:
                raise ConfigError(f"{remote.url}: {what}: {text}") from None
            return False

    return Guard()


def head(obs, client, key: str):
    """The object's head (`.meta`: its size; `.attributes`: its metadata), None where there is none."""
    try:
        return get(obs, client, key, options={"head": True})
    except Exception as exc:  # noqa: BLE001 - obstore's NotFound has its own class per version
        if not_found(exc):
            return None
        raise


def size(obs, client, key: str) -> int | None:
    """The object's size, None where there is none."""
    got = head(obs, client, key)
    return None if got is None else got.meta["size"]


def expired_code(exc: BaseException) -> str:
    """The store's code in an answer that the keys expired (ExpiredToken, RequestExpired, ...)."""
    found = re.search(r"<Code>(\w+)</Code>", str(exc))
    return found.group(1) if found else "ExpiredToken"


def not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or "NotFound" in type(exc).__name__ or "not found" in str(exc).lower()


class Helper:
    """A fresh interpreter (`python -m packer.remote.helper`) that makes a forked process's
    requests: JSON lines in, JSON lines out, one request at a time; it ends with its parent's
    end of the pipe."""

    _mine: Helper | None = None
    _pid = None

    @classmethod
    def get(cls) -> Helper:
        if cls._mine is None or cls._pid != os.getpid():
            cls._mine, cls._pid = cls(), os.getpid()
        return cls._mine

    def __init__(self):
        import subprocess
        import sys
        import threading

        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, "-m", "packer.remote.helper"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def call(self, request: dict) -> dict:
        import json

        with self._lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise ConfigError(f"{request.get('url')}: the download helper of this forked process ended")
        reply = json.loads(line)
        if "error" in reply:
            raise (IntegrityError if reply["error"] == "IntegrityError" else ConfigError)(reply["message"])
        return reply
