"""`packer build`, in the order of its data flow: RAW is scanned into records (`scan`), the
records cut into shards before any decoding (`plan`), each shard's records decoded (`images`)
or tokenized (`text`) into column files by the shard function (`shard`; fixed-size image shards
in row ranges, `pieces`) in a pool of worker processes (`pool`, `workers`) or as Ray tasks
(`ray_tasks`), and the finished shards published under one manifest (`publish`). Around it: every
flag once (`config`), the staging a build claims and resumes (`staging`), `--append` (`append`),
and `run`, which ties them together.
"""
