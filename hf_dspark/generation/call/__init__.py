"""A `generate()` call: the hooks that route it, its settings and plan, its checks and outputs."""
