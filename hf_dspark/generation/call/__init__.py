"""What a `generate()` call resolves before any token: its settings, its `DraftingPlan`, its outputs. Below both loops."""
