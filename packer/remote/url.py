"""A dataset's place in object storage: the URL, its scheme, bucket (or container) and prefix,
and the object key of each file of the dataset dir under it.

`s3://bucket/prefix` (AWS, or any S3-compatible endpoint by AWS_ENDPOINT_URL) and
`az://container/prefix` (Azure Blob Storage). The client for a URL is made in
`packer.remote.client`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packer.errors import ConfigError

SCHEMES = ("s3://", "az://")  # gs:// waits for a GCS server the tests can start (object_store speaks its XML API)
# scheme:/... (two letters at least: C:/ is a drive, not a URL), or a store's name and a colon
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/|(s3|az|gs):", re.IGNORECASE)
GCS = ("Google Cloud Storage is reached through its S3-compatible API: s3://BUCKET/PREFIX with "
       "AWS_ENDPOINT_URL=https://storage.googleapis.com and an HMAC key as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
       "(not tested against GCS itself)")
CREDENTIALS = {"s3://": "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the profile's keys in ~/.aws/credentials "
                        "(AWS_PROFILE; still valid?), and AWS_ENDPOINT_URL for a non-AWS store",
               "az://": "check AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_TOKEN)"}


def is_url(path) -> bool:
    """Whether `path` is written as a URL (`scheme:/...`), of a store mmpack reads or not: one
    it does not read is refused when it is used (`Remote`), never taken for a local path."""
    return isinstance(path, str) and _SCHEME.match(path) is not None


@dataclass(frozen=True)
class Remote:
    """One dataset's place in object storage."""

    url: str

    def __post_init__(self) -> None:
        url = self.url
        if url.startswith(SCHEMES):
            if not self.bucket:
                raise ConfigError(f"{url}: no bucket ({self.scheme}BUCKET/PREFIX)")
            return
        m = _SCHEME.match(url)
        scheme = ((m.group(1) or m.group(2)) if m else url.split(":", 1)[0]).lower()
        if f"{scheme}://" in SCHEMES:
            raise ConfigError(f"{url}: not a URL mmpack reads; write {scheme}://BUCKET/PREFIX")
        if scheme == "gs":
            raise ConfigError(f"{url}: gs:// is not read directly; {GCS}")
        raise ConfigError(f"{url}: {scheme}:// is not a store mmpack reads; it reads s3:// (AWS and any "
                          "S3-compatible store, AWS_ENDPOINT_URL) and az:// (Azure Blob Storage)")

    @property
    def scheme(self) -> str:
        return self.url[:self.url.index("://") + 3]

    @property
    def bucket(self) -> str:
        """The bucket (s3://) or container (az://)."""
        return self.url[len(self.scheme):].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        rest = self.url[len(self.scheme):].split("/", 1)
        return rest[1].strip("/") if len(rest) > 1 else ""

    def key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def where(self, path: str) -> str:
        return f"{self.scheme}{self.bucket}/{self.key(path)}"
