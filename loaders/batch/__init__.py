"""A batch's bytes: the gather of sample ids into one copy per column (`gather`), fixed-shape
rows (`rows`), ragged images into a canvas (`canvas`), strings and ragged 1-D columns
(`ragged`), their copies in C (`native`, checked there, and `_copy.c`), into the reusable
(pinned) buffers (`buffers`) of a ring that never overwrites a batch still held (`ring`), and a
remote dataset's shards fetched ahead of the gather (`fetch`). Imports nothing of
`loaders.order` or `loaders.views`."""
