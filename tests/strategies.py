"""Shared hypothesis strategies: documents, dtypes and image shapes."""

from hypothesis import strategies as st

token_dtypes = st.sampled_from(["<u2", "<u4"])
documents = st.lists(st.lists(st.integers(0, 65535), min_size=0, max_size=40), min_size=1, max_size=30)
image_shapes = st.tuples(st.integers(1, 9), st.integers(1, 9), st.just(3))
