"""URLs of no store mmpack reads (packer.remote.url): refused in one line before any work."""

from __future__ import annotations

import pytest

from loaders import MMapDataset
from packer.cli import main
from packer.errors import ConfigError

from .remote import NEEDS_SERVER

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


@pytest.mark.parametrize("url, said", [
    ("gs://bucket/photos", "S3-compatible API"), ("foo://bucket/photos", "foo:// is not a store"),
    ("s3:/bucket/photos", "write s3://BUCKET/PREFIX"), ("az:bucket", "write az://BUCKET/PREFIX")])
def test_a_url_of_no_store_mmpack_reads_is_refused_in_one_line_before_any_work(built, image_raw, tmp_path, capsys,
                                                                               url, said):
    """gs:// and foo:// went to the S3 endpoint (or AWS itself); s3:/ was a ValueError."""
    from packer.remote import build_dir

    for argv in (["push", str(built["images"]), url], ["pull", url, str(tmp_path / "copy")], ["info", url],
                 ["verify", url], ["build", str(image_raw), url, "-q"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "Traceback" not in err, err
    with pytest.raises(ConfigError, match=said.split(" ")[0]):
        MMapDataset(url)
    assert not build_dir(url).exists() and not (tmp_path / "copy").exists()
