"""S3 credentials that outlive a long run. The client's own chain reads static keys from the
environment and refreshes what it fetches itself (web identity, container and instance
metadata), but reads no shared credentials or config file: a run whose keys come from a profile
(`~/.aws/credentials`, `AWS_PROFILE`), the file a cluster's credential helper rewrites before the
old keys expire, could not start, or went on with the keys it read at start until the store
refused them (a job dead at hour 13 on an expired token).

So where the environment names no keys and no source the client refreshes, the keys come from
the profile, read again whenever its file changes (checked at most every REREAD_S: the client
asks again as the keys it holds near their stated expiry, which is never further away than
that). A profile without keys in the file (SSO, an assumed role, `credential_process`) is read
through boto3's session, whose credentials refresh themselves, where boto3 is installed.
"""

from __future__ import annotations

import configparser
import os
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

from packer.errors import ConfigError

REREAD_ENV = "MMPACK_CREDENTIALS_REREAD_S"
REREAD_S = 30.0
_CLIENT_REFRESHES = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                     "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def files() -> tuple[Path, Path]:
    env = os.environ
    return (Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials").expanduser(),
            Path(env.get("AWS_CONFIG_FILE") or "~/.aws/config").expanduser())


def profile_name() -> str:
    return os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"


def profile_provider():
    """A credential provider for the S3 client where the keys come from a profile, else None
    (the client's own chain: keys in the environment, or a source it refreshes itself)."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") or any(env.get(k) for k in _CLIENT_REFRESHES):
        return None
    if not (env.get("AWS_PROFILE") or any(f.is_file() for f in files())):
        return None  # instance metadata, or nothing: the client's chain says which
    return Profile(profile_name())


def renewable() -> bool:
    """Whether this process reads its keys again while it runs: a profile's (read again as its
    file changes, or boto3's refreshing session) or a source the client refreshes itself (web
    identity, container or instance metadata); not keys in the environment, which no one can
    change within a process. An answer that the keys expired is tried again only where they are."""
    return not os.environ.get("AWS_ACCESS_KEY_ID")


def expired_advice(deadline_s: float) -> str:
    """What to do when the store still says the keys expired."""
    if renewable():
        return (f"they were read again for {deadline_s:g} s (MMPACK_REMOTE_DEADLINE) and stayed expired: check "
                f"that whatever renews them (the helper that rewrites {files()[0]}, SSO, the role) still runs")
    return ("keys in the environment (AWS_ACCESS_KEY_ID, AWS_SESSION_TOKEN) are not read again while a process runs: "
            f"start it with new ones, or keep them in a profile that a helper renews ({files()[0]}, read again as it "
            "changes)")


def profile_region() -> str | None:
    """The profile's region (its config file), where the environment names none."""
    name = profile_name()
    config = _read(files()[1])
    section = name if name == "default" else f"profile {name}"
    return config.get(section, "region", fallback=None) if config.has_section(section) else None


class Profile:
    """The keys of profile `name`, from the credentials file (read again when it changes), else
    from boto3's session for that profile; each answer valid for REREAD_S, so the client asks
    again (and this reads the file only where its mtime moved)."""

    def __init__(self, name: str):
        self.name, self.seen, self.keys, self.session = name, None, None, None
        self.lock = threading.Lock()
        got = os.environ.get(REREAD_ENV)
        self.reread_s = float(got) if got else REREAD_S

    def __call__(self) -> dict:
        with self.lock:
            path = files()[0]
            try:
                st = path.stat()
                stamp = (st.st_mtime_ns, st.st_size)
            except OSError:
                stamp = None
            if stamp != self.seen or self.keys is None:
                self.seen, self.keys = stamp, self._from_file(path)
            keys = self.keys or self._from_boto3()
        until = datetime.now(timezone.utc) + timedelta(seconds=self.reread_s)
        expiry = keys.pop("expiry", None)
        return {**keys, "expires_at": min(until, expiry) if expiry else until}

    def _from_file(self, path: Path) -> dict | None:
        parser = _read(path)
        if not parser.has_section(self.name):
            return None
        get = lambda key: parser.get(self.name, key, fallback=None)  # noqa: E731
        if not (get("aws_access_key_id") and get("aws_secret_access_key")):
            return None
        return {"access_key_id": get("aws_access_key_id"), "secret_access_key": get("aws_secret_access_key"),
                "token": get("aws_session_token")}

    def _from_boto3(self) -> dict:
        """SSO, an assumed role, credential_process: boto3's refreshing credentials."""
        try:
            import boto3
        except ImportError:
            raise ConfigError(f"AWS profile {self.name!r} has no keys in {files()[0]}; for an SSO, role or "
                              "credential_process profile: pip install boto3") from None
        if self.session is None:
            self.session = boto3.Session(profile_name=self.name)
        found = self.session.get_credentials()
        if found is None:
            raise ConfigError(f"AWS profile {self.name!r} gives no credentials; set AWS_ACCESS_KEY_ID and "
                              f"AWS_SECRET_ACCESS_KEY, or keys in {files()[0]}")
        frozen = found.get_frozen_credentials()
        expiry = getattr(found, "_expiry_time", None)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expiry": expiry}


def _read(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except (configparser.Error, OSError, UnicodeDecodeError):
        pass
    return parser

