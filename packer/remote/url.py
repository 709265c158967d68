"""A dataset's place in object storage: the URL, its scheme, bucket (or container) and prefix,
and the object key of each file of the dataset dir under it.

`s3://bucket/prefix` (AWS, or any S3-compatible endpoint by AWS_ENDPOINT_URL) and
`az://container/prefix` (Azure Blob Storage). The client for a URL is made in
`packer.remote.client`.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMES = ("s3://", "az://")  # gs:// waits for a GCS server the tests can start (object_store speaks its XML API)
CREDENTIALS = {"s3://": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a non-AWS store)",
               "az://": "set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_TOKEN)"}


def is_url(path) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


@dataclass(frozen=True)
class Remote:
    """One dataset's place in object storage."""

    url: str

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
