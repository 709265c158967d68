"""The dataset dir, the contract both sides share: the format (`format`, FORMAT.md's twin), how
its column files are written (`writer`) and read (`reader`), checked (`verify`), archived
(`archive`), and how a dir is locked, staged and published (`outdir`), with the table of the raw
inputs a build read (`inputs`) and the keep-aspect size rule (`geometry`). Imports neither
torch, Pillow, tokenizers nor pyarrow.
"""
