"""A batch's bytes: the gather of sample ids into one copy per column (`gather`, its copies in C
in `native` and `_copy.c`) into the reusable (pinned) buffers of a ring that never overwrites a
batch still held (`ring`)."""
