"""Which samples a batch holds, and when: epoch orders as O(1)-memory bijections (`orders`), and
rank shares, the resumable cursor and the resume state, all pure functions of integers
(`sampler`)."""
