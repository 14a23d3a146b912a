"""Sharing drafters: model cards (and, later, Hub upload and format conversion)."""
