"""Routing a `generate()` call: the hooks that take it (`integration`, `custom_generate`), its checks, and `dispatch`
(one prompt to the batch-1 loop, several to the engine, `batch`). The top of `generation/`: nothing below imports it."""
