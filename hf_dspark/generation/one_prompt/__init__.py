"""The batch-1 loop: one prompt, drafted and verified round by round."""
