"""The steps of a round that the batch-1 loop and the batched engine share."""
