"""The batched engine: R requests in one round, joining and leaving between rounds."""
