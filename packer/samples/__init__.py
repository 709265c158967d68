"""Datasets of what users compute once (features, latents, boxes, the fields they keep): the
`Writer` a sample at a time, `map` a function over items in worker processes, both into the
format's `columns` kind; `schema` the columns' specs and the `Image` and `Audio` samples."""
