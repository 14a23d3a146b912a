"""Sharing drafters: model cards, Hub upload, folders stock transformers can run, DeepSpec conversion."""
