"""The dataset dir, the contract both sides share: the format (`format`, FORMAT.md's twin), how
its column files are written (`writer`) and read (`reader`), checked (`verify`), archived
(`archive`), joined (`merge`), and how a dir is locked, staged and published (`outdir`), with
the keep-aspect size rule (`geometry`). Imports neither torch, Pillow, tokenizers nor pyarrow,
and nothing of the build (`packer.builder`) or of object storage (`packer.remote`).
"""
